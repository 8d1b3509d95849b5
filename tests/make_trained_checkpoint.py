"""Writes tests/data/trained-glm-moe-dsa: the tiny glm_moe_dsa (every input dim a multiple of 32) that transformers
trains for 250 steps on four token sequences until its greedy continuation of each follows it, saved by
transformers in bf16, with the sequences beside it (data.json). Tests load it (conftest's `trained_checkpoint`):
a random model's logits are nearly tied, so any rounding flips its greedy tokens; a trained one's say what a format
costs. It is kept in the repository because training took ~150 s of a test run and its outcome depended on the CPU
it ran on (40 steps at lr 3e-3 left some tokens within 0.4 of the next logit: an int4 test passed on one 2-core box
and agreed 83% on another).

    python tests/make_trained_checkpoint.py      (from the checkout; replaces the folder)
"""

import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import build_hf_model  # noqa: E402

FOLDER = Path(__file__).parent / "data" / "trained-glm-moe-dsa"


def main():
    torch.set_num_threads(1)  # as a test worker trained it before: the sums' order is the thread count's
    data = torch.randint(4, 320, (4, 80), generator=torch.Generator().manual_seed(1))
    hf = build_hf_model("glm_moe_dsa", q_lora_rank=64).train()
    optimizer = torch.optim.Adam(hf.parameters(), lr=2e-3)
    for _ in range(250):
        loss = hf(data, labels=data).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"loss after 250 steps: {loss.item():.4f}")
    shutil.rmtree(FOLDER, ignore_errors=True)
    hf.eval().to(torch.bfloat16).save_pretrained(FOLDER)
    (FOLDER / "data.json").write_text(json.dumps(data.tolist()) + "\n")


if __name__ == "__main__":
    main()
