"""A torch optimizer's state as checkpoints hold it: {parameter: its state}, and back.

`full_state` saves each parameter's moments under the parameter's name, whatever the optimizer's
own indexing; both engines keep torch AdamW's per-parameter state, so this is their common form.
"""

from __future__ import annotations

import torch


def torch_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """{parameter: its state} of a torch optimizer (what `full_state` takes)."""
    return dict(optimizer.state)


def load_torch_optimizer_state(optimizer: torch.optim.Optimizer, moments: dict) -> None:
    """Give a torch optimizer the {parameter: state} that `load_full_state` returns."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    optimizer.load_state_dict(
        {
            "state": {index[id(p)]: state for p, state in moments.items()},
            "param_groups": optimizer.state_dict()["param_groups"],
        }
    )
