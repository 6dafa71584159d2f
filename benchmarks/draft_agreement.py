"""How often a draft's greedy next token equals the target's, teacher forced over one passage.

A cheap proxy for speculative decoding's acceptance rate, used to compare derivations of the built-in
model's draft (``tierserve model fetch --draft --draft-layers ...``) before timing any of them.

    .venv/bin/python benchmarks/draft_agreement.py DRAFT_DIR [DRAFT_DIR ...] [--model DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer

from tierserve.model.fetch import fetch_builtin_model

PASSAGE = ("Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter and "
           "his wife. They were poor, but they were happy, and every evening they sat by the fire and told stories "
           "about the days when they were young.")


def greedy(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits[0].argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafts", type=Path, nargs="+")
    parser.add_argument("--model", type=Path, default=None)
    args = parser.parse_args()
    model = args.model or fetch_builtin_model(progress=False)
    ids = torch.tensor([Tokenizer.from_file(str(model / "tokenizer.json")).encode(PASSAGE).ids])
    target = greedy(model, ids)
    print(f"{ids.shape[1]} positions; the target predicts the passage's next token at "
          f"{(target[:-1] == ids[0, 1:]).float().mean():.2f} of them")
    for draft in args.drafts:
        print(f"{draft.name}: agreement {(greedy(draft, ids) == target).float().mean():.3f}")


if __name__ == "__main__":
    main()
