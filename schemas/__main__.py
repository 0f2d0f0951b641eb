"""``python -m schemas DIR``: export the JSON Schema of every record into DIR (``make schemas``:
``spec/jsonschema``)."""

import sys

from schemas.jsonschema import export

if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m schemas OUTPUT_DIR", file=sys.stderr)
        raise SystemExit(2)
    for path in export(sys.argv[1]):
        print(path)
