"""The rows of the paper's Table 3 (§6.2, "Model Variations"), scaled to any base model, and one row it lacks.

Each row changes the base model as Table 3 does, by the same factors where the paper varies a size, by the paper's
own values where it varies a rate:

- (A) h in {1, h/2, 2h, 4h} with d_k = d_v = d_model / h (the paper's base: h 8, rows 1, 4, 16, 32);
- (B) d_k in {d_k / 2, 2 d_k} at the base's h (the paper lowers d_k only: 16 and 32 against 64);
- (C) N in {N / 2, 3N / 2}; d_model in {d_model / 2, 2 d_model}, with d_ff in proportion and d_k = d_v = d_model / h;
  d_ff in {d_ff / 2, 2 d_ff};
- (D) P_drop in {0.0, 0.2} and epsilon_ls in {0.0, 0.2}, the paper's values;
- (E) learned positional embeddings instead of sinusoids (§3.5);
- (U) not in the paper: attention without the 1 / sqrt(d_k) scale of Eq. 1 (§3.2.1), at the base's d_k and at
  2 d_k (row B2's), whose scaled twins are the base row and B2.

For Transformer-tiny (d_model 128, h 4, N 4, d_ff 256) these are the rows of docs/table3.md.
"""

from dataclasses import dataclass, field
from typing import Any

from ..model.configuration_vaswani import VaswaniConfig

# The VaswaniConfig field that turns the 1 / sqrt(d_k) of Eq. 1 off (rows U).
UNSCALED_FIELD = "scale_attention"
# The groups in the order of the paper's table, and the one row that is the base.
GROUPS = ("base", "A", "B", "C", "D", "E", "U")
BASE = "base"


@dataclass(frozen=True)
class Row:
    """One row of Table 3: a name ("base", "A1", ..., "U2"), its group, and its changes to the base model.

    Attributes:
        name: the row's name, its group's letter and its place in the group ("base" for the base row).
        group: "base", or the letter of its group in Table 3 ("U": attention without the scale).
        overrides: the VaswaniConfig fields the row sets, on top of the base model's.
    """

    name: str
    group: str
    overrides: dict[str, Any] = field(default_factory=dict)


def _attention_fits(d_model: int, heads: int) -> bool:
    return heads >= 1 and d_model % heads == 0


def table3_rows(base: VaswaniConfig) -> dict[str, Row]:
    """Every row of Table 3 scaled to `base` (module docstring), by name, in the table's order.

    A value that equals the base's, or an impossible size (d_model / h not whole, an odd d_model, a size below 1),
    leaves its row out. Rows U drop the scale at the base's d_k and at twice it (B2's d_k).

    Args:
        base: the base model (a preset with its overrides).

    Returns:
        {name: row}, "base" first.
    """
    d_model, d_ff, heads, d_k = base.d_model, base.d_ff, base.num_attention_heads, base.key_dim
    layers = base.encoder_layers
    groups: dict[str, list[dict[str, Any]]] = {group: [] for group in GROUPS}
    groups[BASE].append({})
    for h in dict.fromkeys((1, heads // 2, 2 * heads, 4 * heads)):
        if h != heads and _attention_fits(d_model, h):
            groups["A"].append(dict(num_attention_heads=h, d_k=d_model // h, d_v=d_model // h))
    groups["B"] += [dict(d_k=k) for k in (d_k // 2, 2 * d_k) if k >= 1]
    groups["C"] += [dict(encoder_layers=n, decoder_layers=n) for n in (layers // 2, layers + layers // 2) if n >= 1]
    for width in (d_model // 2, 2 * d_model):
        if width % 2 == 0 and _attention_fits(width, heads):
            per_head = width // heads
            groups["C"].append(dict(d_model=width, d_ff=d_ff * width // d_model, d_k=per_head, d_v=per_head))
    groups["C"] += [dict(d_ff=inner) for inner in (d_ff // 2, 2 * d_ff) if inner >= 1]
    groups["D"] += [dict(dropout=p) for p in (0.0, 0.2) if p != base.dropout]
    groups["D"] += [dict(label_smoothing=eps) for eps in (0.0, 0.2) if eps != base.label_smoothing]
    if base.position_embedding_type != "learned":
        groups["E"].append(dict(position_embedding_type="learned"))
    groups["U"] += [{UNSCALED_FIELD: False}, {UNSCALED_FIELD: False, "d_k": 2 * d_k}]
    rows = {}
    for group, changes in groups.items():
        for number, overrides in enumerate(changes, 1):
            name = BASE if group == BASE else group if len(changes) == 1 and group == "E" else f"{group}{number}"
            rows[name] = Row(name, group, overrides)
    return rows


def select_rows(rows: dict[str, Row], names: str) -> list[Row]:
    """The rows `names` asks for: comma-separated row names or group letters ("base,A,B1"); "all" for every row.

    The base row is always among them: every difference is read against it.

    Args:
        rows: the rows there are (`table3_rows`).
        names: the selection, as `--rows` takes it.

    Returns:
        The rows, in the table's order.

    Raises:
        ValueError: a name is no row or group here; the message lists the rows.
    """
    wanted = {BASE}
    for name in (part.strip() for part in names.split(",")):
        if name == "all":
            wanted.update(rows)
        elif name in rows:
            wanted.add(name)
        elif name in GROUPS and any(row.group == name for row in rows.values()):
            wanted.update(row.name for row in rows.values() if row.group == name)
        elif name:
            raise ValueError(
                f"--rows: {name!r} is no row of Table 3 here; give some of {', '.join(rows)}, a group "
                f"letter ({', '.join(g for g in GROUPS[1:] if any(r.group == g for r in rows.values()))}) or all."
            )
    return [row for name, row in rows.items() if name in wanted]
