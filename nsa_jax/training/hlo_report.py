"""Which collectives a compiled step contains: kind, result shape, bytes and the JAX op behind each.

Used by the training loop (`config.train.hlo_report`) to show where data moves between devices:
parameter all-gathers and gradient reduce-scatters under FSDP, activation all-reduces under tensor
parallelism, and (the point of the check) none inside the attention op, whose kernels run per device
under shard_map (nsa_jax.ops).
"""

from __future__ import annotations

import collections
import math
import re

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
         "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
# "%x = <result shape> <kind>[-start](operands...), ..., metadata={op_name="..." ...}"
_LINE = re.compile(r"=\s*(?P<shape>.+?)\s+(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"(?P<dt>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_OP_NAME = re.compile(r'op_name="(?P<name>[^"]*)"')


def _arrays(shape: str):
  return [(m["dt"], tuple(int(d) for d in m["dims"].split(",") if d))
          for m in _ARRAY.finditer(shape)]


def _top_level(shape: str) -> list[str]:
  """'(a, (b, c))' -> ['a', '(b, c)']; a non-tuple shape -> [shape]."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, cur = [], 0, ""
  for ch in shape[1:-1]:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append(cur.strip())
      cur = ""
    else:
      cur += ch
  return parts + ([cur.strip()] if cur.strip() else [])


def _results(kind: str, is_start: bool, shape: str) -> list:
  """The arrays a collective produces. XLA combines several collectives into one instruction with
  a tuple result; an async all-gather / collective-permute start returns (operands, results[,
  scratch]) where either may itself be a tuple."""
  if is_start and kind in ("all-gather", "collective-permute", "all-to-all", "reduce-scatter"):
    parts = _top_level(shape)
    if len(parts) >= 2:
      return _arrays(parts[1])
  return _arrays(shape)


def collectives(hlo_text: str) -> list[dict]:
  """One record per collective instruction of an optimized HLO module's text: kind, the result
  arrays' shapes (several when XLA combined collectives), their total bytes, the JAX op name.
  Counted per compiled instruction: one inside a while loop (gradient accumulation) runs once per
  iteration but is listed once."""
  out = []
  for line in hlo_text.splitlines():
    m = _LINE.search(line)
    if not m or "-done" in line.split("=", 1)[0]:
      continue
    arrays = _results(m["kind"], bool(m["start"]), m["shape"]) or [("f32", ())]
    name = _OP_NAME.search(line)
    out.append(dict(kind=m["kind"], dtype=arrays[0][0], shape=list(arrays[0][1]),
                    shapes=[list(d) for _, d in arrays],
                    bytes=sum(_DTYPE_BYTES.get(dt, 4) * math.prod(d) for dt, d in arrays),
                    op_name=name["name"] if name else ""))
  return out


def summarize(records: list[dict], seq_len: int) -> dict:
  """Counts and bytes per kind, plus the collectives that carry a sequence-length dimension and
  those whose op_name points into an attention op (shard_map body or the kernels)."""
  per_kind = collections.defaultdict(lambda: {"count": 0, "bytes": 0})
  for r in records:
    per_kind[r["kind"]]["count"] += 1
    per_kind[r["kind"]]["bytes"] += r["bytes"]
  # Activations only: parameters (op names "state[...]") whose width happens to equal T are not.
  with_seq = [r for r in records if not r["op_name"].startswith("state[")
              and any(seq_len in sh for sh in r.get("shapes", [r["shape"]]))]
  # nsa_jax.ops names its ops with jax.named_scope; resharding at the op's boundary counts too.
  in_attention = [r for r in records if re.search(r"nsa_attention|dense_attention", r["op_name"])]
  return {"per_kind": dict(per_kind), "with_sequence_dim": with_seq,
          "in_attention_op": in_attention, "total": len(records),
          "note": "counts and bytes are per compiled instruction (a collective inside a loop, e.g. "
                  "gradient accumulation, runs once per iteration); bytes are result sizes"}
