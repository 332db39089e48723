"""`python -m server.docgen` rewrites the generated blocks of docs/; `--check` only lists the
stale pages and exits 1 if there are any."""

from __future__ import annotations

import argparse
import sys

from server.docgen.blocks import REPO_ROOT, stale_pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m server.docgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="list stale pages, change nothing")
    args = parser.parse_args(argv)
    stale = stale_pages(write=not args.check)
    for page in stale:
        verb = "stale" if args.check else "rewritten"
        print(f"{page.relative_to(REPO_ROOT)}: {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
