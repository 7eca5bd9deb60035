"""Merge self-distilled datasets (make_data outputs of one backbone) into one, to train on the mix.

    python scripts/merge_data.py data/sharegpt-smollm2 data/sharegpt-long --output_dir data/sharegpt-mix
    python scripts/merge_data.py data/mix/part-000 --output_dir distilled/part-000 --token_dtype uint16  # compact copy
"""

from __future__ import annotations

import argparse
import sys

from tokenmaxx.scripts.errors import run_script
from tokenmaxx.training.data_folder import TOKEN_DTYPES
from tokenmaxx.training.merge_data import merge_data


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", help="make_data output folders, in the order their rows are kept")
    parser.add_argument("--output_dir", "--output-dir", required=True, help="new folder for the merged dataset")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output_dir")
    parser.add_argument("--token_dtype", default="int64", choices=tuple(TOKEN_DTYPES),
                        help="token id storage: int32 halves the size, uint16 (vocabularies under 65,536) quarters it "
                             "(a compact copy; one part is just copied)")
    args = parser.parse_args(argv)
    dataset = merge_data(args.parts, args.output_dir, overwrite=args.overwrite, token_dtype=args.token_dtype)
    print(f"merge_data: {args.output_dir}: {len(dataset)} records from {len(args.parts)} datasets", flush=True)
    return dataset


if __name__ == "__main__":
    sys.exit(run_script(main))
