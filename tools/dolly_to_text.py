"""Turn databricks-dolly-15k records into one training text per record ({"text": ...} jsonl).

The text of a record is its context, instruction and response, in that order, joined by a
newline; an empty context is left out. Every line must be a JSON object whose instruction,
context and response are strings, otherwise the run stops with `error: FILE:LINE: ...` and
writes nothing (the output is written under a temporary name and renamed at the end).

    python tools/dolly_to_text.py --input databricks-dolly-15k.jsonl --output dolly_text.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DOLLY_KEYS = ("instruction", "context", "response")


class DollyError(Exception):
    """A dolly line that is not a record with string instruction/context/response."""


def record_text(line: bytes, where: str) -> str:
    try:
        record = json.loads(line.decode("utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as err:
        raise DollyError(f"{where}: undecodable bytes (not UTF-8 at column {err.start + 1})") from None
    except json.JSONDecodeError as err:
        raise DollyError(f"{where}: malformed JSON ({err.msg}: column {err.colno})") from None
    if not isinstance(record, dict):
        raise DollyError(f"{where}: expected a JSON object with keys {', '.join(DOLLY_KEYS)}")
    for key in DOLLY_KEYS:
        if not isinstance(record.get(key), str):
            problem = "missing key" if key not in record else "non-string value for key"
            raise DollyError(f"{where}: {problem} '{key}' (a dolly record has {', '.join(DOLLY_KEYS)})")
    parts = [record["context"], record["instruction"], record["response"]]
    return "\n".join(parts if record["context"].strip() else parts[1:])


def convert(input_path: str, output_path: str) -> int:
    """Write the text jsonl; returns the number of records."""
    tmp_path = f"{output_path}.tmp-{os.getpid()}"
    count = 0
    try:
        with open(input_path, "rb") as source, open(tmp_path, "w", encoding="utf-8") as sink:
            for line_no, line in enumerate(source, start=1):
                if not line.strip():
                    continue
                text = record_text(line, f"{input_path}:{line_no}")
                sink.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                count += 1
        if count == 0:
            raise DollyError(f"{input_path}: no records")
        os.replace(tmp_path, output_path)
    finally:
        Path(tmp_path).unlink(missing_ok=True)
    return count


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="databricks-dolly-15k.jsonl")
    parser.add_argument("--output", required=True, help="jsonl with one {'text': ...} per record")
    args = parser.parse_args(argv)
    try:
        if not os.path.isfile(args.input):
            raise DollyError(f"--input {args.input}: file not found")
        count = convert(args.input, args.output)
    except DollyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"[dolly] {count} records -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
