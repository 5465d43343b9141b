"""Write a small synthetic instruction set for ``yamls/demo_cpu_sft.yaml`` (jsonl, offline).

Three tasks a small model can learn in a few hundred steps -- adding two numbers, reversing a
word, upper-casing a phrase -- in both formats ``data.task: sft`` reads: ``prompt``/``response``
lines and chat ``messages`` lines (some with a system message)::

    python examples/make_instructions.py examples/data/instructions.jsonl --n 400 --seed 0
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ["apple", "river", "stone", "garden", "window", "candle", "forest", "silver", "mirror",
         "thunder", "harbor", "pepper", "lantern", "meadow", "castle", "violet", "copper",
         "breeze", "marble", "falcon"]


def example(rng: random.Random) -> dict:
    """One example: a dict with ``prompt``/``response`` or ``messages``."""
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randrange(100), rng.randrange(100)
        prompt, response = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    elif kind == 1:
        w = rng.choice(WORDS)
        prompt, response = f"Reverse the word {w}.", f"The word {w} reversed is {w[::-1]}."
    else:
        phrase = " ".join(rng.sample(WORDS, 2))
        prompt, response = f"Write in capitals: {phrase}", phrase.upper()
    if rng.random() < 0.5:
        return {"prompt": prompt, "response": response}
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": "Answer in one short sentence."})
    return {"messages": messages}


def write(path: str | Path, n: int = 400, seed: int = 0) -> Path:
    """Write ``n`` examples to ``path`` (one JSON object per line); returns the path."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(example(rng)) + "\n" for _ in range(n)), encoding="utf-8")
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write(args.out, args.n, args.seed))
