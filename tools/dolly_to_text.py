"""Turn databricks-dolly-15k records into one training text per record ({"text": ...} jsonl).

The text of a record is its context, instruction and response, in that order, joined by a
newline; an empty context is left out. Every line must be a JSON object whose instruction,
context and response are strings, otherwise the run stops with `error: FILE:LINE: ...` and
writes nothing (the output is written under a temporary name and renamed at the end); so do an
output that cannot be written and SIGTERM. An output whose text is already the same is left
untouched (its mtime too), so what is built from it is not rebuilt for nothing.

    python tools/dolly_to_text.py --input databricks-dolly-15k.jsonl --output dolly_text.jsonl
"""
from __future__ import annotations

import argparse
import filecmp
import json
import os
import signal
import sys

from megatron.errors import ZeroLabError

DOLLY_KEYS = ("instruction", "context", "response")


class DollyError(ZeroLabError):
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


def convert(input_path: str, output_path: str) -> tuple[int, bool]:
    """Write the text jsonl; returns the number of records and whether the output changed."""
    tmp_path = f"{output_path}.tmp-{os.getpid()}"
    count = 0
    try:
        try:
            sink = open(tmp_path, "w", encoding="utf-8")
        except OSError as err:
            raise DollyError(f"--output {output_path}: cannot write ({err.strerror or err})") from None
        with open(input_path, "rb") as source, sink:
            for line_no, line in enumerate(source, start=1):
                if not line.strip():
                    continue
                text = record_text(line, f"{input_path}:{line_no}")
                sink.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
                count += 1
        if count == 0:
            raise DollyError(f"{input_path}: no records")
        changed = not (os.path.isfile(output_path) and filecmp.cmp(tmp_path, output_path, shallow=False))
        if changed:
            try:
                os.replace(tmp_path, output_path)
            except OSError as err:
                raise DollyError(f"--output {output_path}: cannot write ({err.strerror or err})") from None
    finally:
        if os.path.exists(tmp_path):  # not there when the folder itself is not writable
            os.unlink(tmp_path)
    return count, changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="databricks-dolly-15k.jsonl")
    parser.add_argument("--output", required=True, help="jsonl with one {'text': ...} per record")
    args = parser.parse_args(argv)
    try:
        if not os.path.isfile(args.input):
            raise DollyError(f"--input {args.input}: file not found")
        count, changed = convert(args.input, args.output)
    except DollyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"[dolly] {count} records -> {args.output}{'' if changed else ' (unchanged)'}")
    return 0


def _stop(signum, frame):
    # SystemExit runs the cleanup in convert() on its way out; its message goes to stderr.
    raise SystemExit(f"error: stopped by {signal.Signals(signum).name}; nothing written")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop)
    sys.exit(main())
