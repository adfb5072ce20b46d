"""How the planner reads the sizes, bandwidths, times and token counts its flags are written in; PlanError, the
one-line refusal of a flag it cannot use."""
import re

from megatron.errors import ZeroLabError


class PlanError(ZeroLabError, ValueError):
    """A flag the planner cannot use; the message names it."""


def parse_memory(text: str) -> float:
    """'40GB', '80GiB', '40' (GB) -> GB of 2**30 bytes, as the memory log line prints them."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(GB|GiB|G)?\s*", text, re.I)
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"--gpu-memory {text!r}: expected a size such as 40GB or 80GiB")
    return float(match.group(1))


def parse_bandwidth(text: str, flag: str) -> float:
    """'200Gbit', '200Gbit/s', '200Gbps', '200Gb/s' (bits), '25GB/s', '25GB', '25' (bytes) -> Gbit/s."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(Gbit|Gbps|Gb|gbit|gbps|GB|G)?(/s)?\s*", text)
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"{flag} {text!r}: expected a bandwidth such as 200Gbit (Gbit/s) or 25GB/s")
    return float(match.group(1)) * (1 if match.group(2) in ("Gbit", "Gbps", "Gb", "gbit", "gbps") else 8)


def parse_latency(text: str) -> float:
    """'10us', '0.01ms', '10' (us) -> microseconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(us|ms)?\s*", text)
    if not match:
        raise PlanError(f"--latency {text!r}: expected a time such as 10us or 0.01ms")
    return float(match.group(1)) * (1000 if match.group(2) == "ms" else 1)


def parse_tokens(text: str) -> float:
    """'300B', '1.5T', '500M', '3e11' -> tokens."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([KMBT])?\s*", text, re.I)
    if not match or float(match.group(1)) <= 0:
        raise PlanError(f"--tokens {text!r}: expected a count such as 300B or 1.5T")
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}.get((match.group(2) or "").upper(), 1)
    return float(match.group(1)) * scale
