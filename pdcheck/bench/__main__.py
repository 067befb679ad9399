"""`python -m pdcheck.bench transfer-bench ...` (the README's): pdcheck's one entry point, under another name."""

from __future__ import annotations

from pdcheck.__main__ import main

if __name__ == "__main__":
    main()
