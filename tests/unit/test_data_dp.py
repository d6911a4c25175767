"""Two gloo ranks prepare the same run directory at once (manifest and token cache written
concurrently) and each loads its DP shard: the gathered shards equal the single-process batches."""
import json

import torch
import torch.distributed as dist

from megatron_tc.data import DataConfig, prepare_data
from megatron_tc.data.synthetic import train_tiny_tokenizer, write_synthetic_corpus
from megatron_tc.testing import run_distributed

STEPS, GB, MBS = 3, 4, 1


def _cfg(corpus: str, tok: str) -> DataConfig:
    return DataConfig.from_dict({"source": {"kind": "text", "paths": [corpus]}, "tokenizer": tok, "seq_len": 16,
                                 "split": {"seed": 2, "calibration_fraction": 0.1, "eval_fraction": 0.1}})


def _worker(rank: int, world: int, corpus: str, tok: str, run_dir: str) -> None:
    dist.barrier()  # start together: both ranks race to write the manifest and the cache
    data = prepare_data(_cfg(corpus, tok), run_dir, model_vocab_size=320)
    loader = data.loader("train", global_batch_size=GB, micro_batch_size=MBS, dp_rank=rank, dp_size=world, seed=9)
    mine = torch.cat([b["input_ids"] for _ in range(STEPS) for b in loader.next_step()])  # [STEPS*GB/world, T]
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    single = data.loader("train", global_batch_size=GB, micro_batch_size=GB, seed=9)
    for s in range(STEPS):
        want = single.next_step()[0]["input_ids"]
        per = GB // world
        got = torch.cat([g[s * per : (s + 1) * per] for g in gathered])
        assert torch.equal(got, want), f"step {s}: the DP shards do not make up the global batch"


def test_concurrent_prepare_and_dp_shards(tmp_path):
    write_synthetic_corpus(tmp_path / "corpus", n_docs=10, words_per_doc=(50, 200), seed=4)
    tok = train_tiny_tokenizer(tmp_path / "tok")
    run_distributed(_worker, 2, str(tmp_path / "corpus"), str(tok), str(tmp_path / "run"), timeout=240)
    manifest = json.loads((tmp_path / "run" / "data_manifest.json").read_text())
    assert manifest["summary"]["train"]["tokens"] > 0
    assert len(list((tmp_path / "run" / "data_cache").glob("train-*"))) == 1
    assert not list((tmp_path / "run" / "data_cache").glob(".*"))  # no temporary leftovers
    assert not [p for p in (tmp_path / "run").iterdir() if p.name.startswith(".")]
