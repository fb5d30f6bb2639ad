#!/usr/bin/env python
"""Tree packing vs sequence packing, forward+backward of one micro-batch: `asyncgrpo tree bench` as a script.

    python bench/tree_bench.py --groups 2 --generations 8 --prompt 1024 --completion 256 --threads 1

Same code and flags as the CLI (see `asyncgrpo tree bench --help`); prints a table and a JSON line.
"""

import sys

from asyncgrpo.cli import main

if __name__ == "__main__":
    sys.exit(main(["tree", "bench", *sys.argv[1:]]))
