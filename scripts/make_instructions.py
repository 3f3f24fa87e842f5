"""Build the PEP-title instruction set from the shipped PEP corpus (deterministic; output is committed).

    python scripts/make_instructions.py            # writes data/instructions/pep_titles.jsonl
    python scripts/make_instructions.py --check    # exit 1 if the committed file differs from a fresh build

Each PEP with an `Abstract` section becomes one JSON Lines record

    {"id": "pep-0302", "prompt": "What is the title of the PEP with this abstract? This PEP proposes ...",
     "response": "New Import Hooks"}

The abstract is the first paragraph of the `Abstract` section with reStructuredText
markup reduced to plain text, cut to whole sentences of at most MAX_WORDS words
(so prompt + title fit a 128-token example); the response is the `Title:` header.
Records are in corpus order (sorted by PEP id); the same corpus gives the same bytes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data/corpora/python-peps.jsonl.gz"
OUT = REPO / "data/instructions/pep_titles.jsonl"
QUESTION = "What is the title of the PEP with this abstract?"
MAX_WORDS = 40


def rst_to_text(s: str) -> str:
    """Plain text from a reStructuredText fragment: roles, links, literals, references, emphasis."""
    s = re.sub(r":pep:`(?:[^`<]*<)?(\d+)>?`", r"PEP \1", s)  # :pep:`8` / :pep:`title <8>`
    s = re.sub(r":\w+(?::\w+)*:`([^`<]*?)\s*(?:<[^`>]*>)?`", r"\1", s)  # :func:`x`, :ref:`text <target>`
    s = re.sub(r"`([^`<]+?)\s*<[^`>]+>`__?", r"\1", s)  # `text <url>`_
    s = re.sub(r"``([^`]+)``", r"\1", s)  # ``literal``
    s = re.sub(r"`([^`]+)`_{0,2}", r"\1", s)  # `ref`_ / `interpreted`
    s = re.sub(r"\s*\[[^\]\s]+\]_", "", s)  # citations [1]_
    s = re.sub(r"(?<![\w*])(\*\*?)(\S|\S[^*]*?\S)\1(?![\w*])", r"\2", s)  # *emphasis*, **strong**
    s = re.sub(r"\b([A-Za-z0-9][\w-]*[A-Za-z0-9])_(?=\W|$)", r"\1", s)  # reference_ (not __dunder__)
    s = re.sub(r"\\(\S)", r"\1", s.replace("\\ ", ""))  # escapes: \*\*kwargs, Group\ s
    return re.sub(r"\s+", " ", s).strip()


def title_of(text: str) -> str | None:
    m = re.search(r"^Title:[ \t]*(.+(?:\n[ \t]+.+)*)", text, re.M)
    return rst_to_text(m.group(1)) if m else None


def abstract_of(text: str) -> str | None:
    """The first prose paragraph of the `Abstract` section, or None when there is none."""
    m = re.search(r"^Abstract\n[=\-~^]{3,}\n(.*?)(?=^\S[^\n]*\n[=\-~^]{3,}\n|\Z)", text, re.M | re.S)
    if not m:
        return None
    for para in re.split(r"\n\s*\n", m.group(1)):
        if (
            para.strip()
            and not para.lstrip().startswith(("..", "::", "*", "-", "|", ">>>"))
            and not para.startswith(" ")
        ):
            return rst_to_text(para)
    return None


def shorten(text: str, max_words: int = MAX_WORDS) -> str:
    """Whole sentences up to max_words words; a first sentence longer than that is cut at max_words."""
    sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z(])", text)
    out: list[str] = []
    for sent in sentences:
        if len(" ".join(out + [sent]).split()) > max_words:
            break
        out.append(sent)
    if not out:
        out = [" ".join(sentences[0].split()[:max_words]) + " ..."]
    return " ".join(out)


def build(corpus: Path = CORPUS) -> tuple[list[dict], dict[str, int]]:
    records, skipped = [], {"no_abstract": 0, "no_title": 0}
    with gzip.open(corpus, "rt", encoding="utf-8") as f:
        docs = sorted((json.loads(line) for line in f if line.strip()), key=lambda d: d["id"])
    for doc in docs:
        title, abstract = title_of(doc["text"]), abstract_of(doc["text"])
        if not title:
            skipped["no_title"] += 1
            continue
        if not abstract:
            skipped["no_abstract"] += 1
            continue
        records.append({"id": doc["id"], "prompt": f"{QUESTION} {shorten(abstract)}", "response": title})
    return records, skipped


def render(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    args = ap.parse_args(argv)
    records, skipped = build()
    data = render(records)
    if args.check:
        same = args.out.is_file() and args.out.read_bytes() == data
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from a fresh build; rerun without --check'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"{args.out}: {len(records)} records (skipped: {skipped})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
