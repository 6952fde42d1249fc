"""The row layout of verl's RL parquet datasets (what `verl.utils.dataset.RLHFDataset` reads).

One row per problem:
    data_source   the dataset's Hub id; verl's default reward (verl.utils.reward_score.default_compute_score)
                  picks its scorer from it (GSM8K: "#### <answer>", MATH: "\\boxed{<answer>}")
    prompt        the chat: one user message, the problem plus how to write the final answer
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": <the reference answer>}
    extra_info    {"split", "index"}
"""

from __future__ import annotations

GSM8K = "openai/gsm8k"
MATH = "DigitalLearningGmbH/MATH-lighteval"
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def make_row(data_source: str, question: str, instruction: str, answer: str, split: str, index: int) -> dict:
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": f"{question} {instruction}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": split, "index": index},
    }
