"""Turn GSM8K or MATH from the Hugging Face Hub into the parquet files verl's RL dataset reads.

    python examples/preprocess_data.py --dataset gsm8k --out ~/data/gsm8k   # train.parquet, test.parquet
    python examples/preprocess_data.py --dataset math  --out ~/data/math

One row per problem, in the layout `odc_plugin.verl.data` describes.
Needs `pip install datasets` and access to the Hub.
"""

from __future__ import annotations

import argparse
import os

from odc_plugin.verl.data import GSM8K, GSM8K_INSTRUCTION, MATH, MATH_INSTRUCTION, make_row


def gsm8k_answer(solution: str) -> str:
    """GSM8K solutions end with '#### <number>'; the reward compares the number without commas."""
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def math_answer(solution: str) -> str:
    """The content of the last \\boxed{...} of a MATH solution, extracted the way verl's scorer does."""
    from verl.utils.reward_score.math_reward import last_boxed_only_string, remove_boxed

    return remove_boxed(last_boxed_only_string(solution))


def gsm8k_row(example: dict, index: int, split: str) -> dict:
    return make_row(GSM8K, example["question"], GSM8K_INSTRUCTION, gsm8k_answer(example["answer"]), split, index)


def math_row(example: dict, index: int, split: str) -> dict:
    return make_row(MATH, example["problem"], MATH_INSTRUCTION, math_answer(example["solution"]), split, index)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["gsm8k", "math"], required=True)
    parser.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    args = parser.parse_args(argv)

    import datasets

    if args.dataset == "gsm8k":
        source, row = datasets.load_dataset(GSM8K, "main"), gsm8k_row
    else:
        source, row = datasets.load_dataset(MATH), math_row
    out = os.path.expanduser(args.out)
    os.makedirs(out, exist_ok=True)
    for split in ("train", "test"):
        ds = source[split]
        ds = ds.map(row, with_indices=True, fn_kwargs={"split": split}, remove_columns=ds.column_names)
        path = os.path.join(out, f"{split}.parquet")
        ds.to_parquet(path)
        print(f"{path}: {len(ds)} rows")


if __name__ == "__main__":
    main()
