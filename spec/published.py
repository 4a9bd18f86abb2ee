"""The seed chapter's published numbers for its fixture, exactly as printed (six decimals).

These are data from the seed document, the target of rule VALUE-SEED-FIXTURE; a project test
checks them against the seed program's trace in ``golden/seed``.
"""

from __future__ import annotations

__all__ = ["PUBLISHED_LOGITS", "PUBLISHED_LOSS", "PUBLISHED_PREDICTIONS", "PUBLISHED_STAGES"]

# Stage name -> one row of printed values per token position (batch 1, tokens 3).
PUBLISHED_STAGES: dict[str, tuple[tuple[str, ...], ...]] = {
    "embedding": (
        ("0.682029", "0.153556", "-0.351563", "0.356056"),
        ("0.104430", "0.699156", "0.051971", "-0.160217"),
        ("0.216629", "0.121409", "-0.669558", "0.184635"),
    ),
    "block-0": (
        ("0.104024", "0.415376", "1.084060", "0.010557"),
        ("-0.772509", "0.841246", "1.816030", "0.156071"),
        ("-0.863157", "0.323022", "1.293906", "-0.329775"),
    ),
    "block-1": (
        ("0.824108", "-0.067020", "-0.389118", "-1.141190"),
        ("-0.183854", "0.605829", "0.709748", "-0.521934"),
        ("0.486458", "-0.038886", "-0.020587", "-1.391467"),
    ),
    "final-norm": (
        ("1.127388", "-0.091684", "-0.532317", "-1.561160"),
        ("-0.338936", "1.116846", "1.308420", "-0.962186"),
        ("0.659735", "-0.052737", "-0.027920", "-1.887109"),
    ),
}
PUBLISHED_LOGITS: tuple[tuple[str, ...], ...] = (
    ("0.386115", "0.276091", "0.301266", "-0.460642", "-0.735173"),
    ("-0.862249", "0.967613", "-0.991545", "-0.446363", "1.234533"),
    ("-0.220241", "0.332921", "-0.193218", "-0.267554", "-0.500487"),
)
PUBLISHED_PREDICTIONS: tuple[int, ...] = (0, 4, 1)
PUBLISHED_LOSS = "2.045535"
