"""gguf_reading(): one parsed header per GGUF file and one tensor-name map per architecture while
open, the gguf module exactly as before afterwards (also after an error)."""
import pytest

gguf = pytest.importorskip("gguf")

from megatron_tc.convert.gguf_memo import gguf_reading  # noqa: E402
from megatron_tc.data.synthetic import write_gguf_tokenizer  # noqa: E402


def test_a_file_is_parsed_once_and_reads_the_same(tmp_path):
    path = write_gguf_tokenizer(tmp_path / "tok.gguf", add_bos=True)
    plain = gguf.GGUFReader(path)
    with gguf_reading():
        first = gguf.GGUFReader(str(path))
        with gguf_reading():  # nested: the outer cache
            again = gguf.GGUFReader(tmp_path / "." / "tok.gguf")
        assert again is first
        assert gguf.GGUFReader(path) is first
    assert sorted(first.fields) == sorted(plain.fields)
    assert [t.name for t in first.tensors] == [t.name for t in plain.tensors]
    assert (first.tensors[0].data == plain.tensors[0].data).all()


def test_name_maps_are_shared_and_equal_to_a_fresh_build():
    arch = gguf.MODEL_ARCH.LLAMA
    fresh = gguf.get_tensor_name_map(arch, 3)
    with gguf_reading():
        shared = gguf.get_tensor_name_map(arch, 3)
        assert gguf.get_tensor_name_map(arch, 3) is shared
        assert gguf.get_tensor_name_map(arch, 4) is not shared
    assert shared.mapping == fresh.mapping


def test_the_module_is_restored_also_after_an_error(tmp_path):
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(RuntimeError, match="inside"):
        with gguf_reading():
            assert gguf.GGUFReader is not reader_class
            raise RuntimeError("inside")
    assert gguf.GGUFReader is reader_class and gguf.get_tensor_name_map is name_map
    path = write_gguf_tokenizer(tmp_path / "tok.gguf", add_bos=False)
    assert gguf.GGUFReader(path) is not gguf.GGUFReader(path)  # no cache outside the block
