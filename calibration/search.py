"""The one parameter search of identification: the cross-entropy method, then a pattern search.

Parameters are searched as `theta` [G, P]: G independent groups (an arm's joints, each
ranked by its own error; one group for a servo bench) of P parameters each, as the caller
maps them (multipliers as logs). The caller's objective scores a batch of candidates:

    def objective(theta):             # [B, G, P] -> Scored
        err = ...                     # [B, G]: each candidate's error in each group
        return Scored(err)            # rank: what each parameter is ranked by (default: err)

    best = search(objective, mean, std, lo, hi, SearchCfg(), say=print, label="fit")

`cross_entropy` samples B candidates around the mean (candidate 0 is the mean itself), keeps
each group's best-scored mean and moves the mean and spread onto each (group, parameter)'s
elites; `polish` then moves each parameter one step up and down at once and follows
correlated valleys (gain against friction) that the sampled search leaves short of their floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class SearchCfg:
    population: int = 128              # candidates per cross-entropy step (docs/sysid.md: why not 32)
    elites: int = 32                   # ... of which the best this many set the next step
    iterations: int = 12               # cross-entropy steps
    polish_steps: int = 8              # pattern-search steps after them
    seed: int = 0

    def validate(self) -> None:
        if self.population < 2 or not 1 <= self.elites < self.population:
            raise ValueError("population/elites: need population >= 2 and 1 <= elites < population")
        if self.iterations < 1 or self.polish_steps < 0:
            raise ValueError("iterations/polish_steps: need iterations >= 1 and polish_steps >= 0")


@dataclass
class Scored:
    error: torch.Tensor                # [B, G] each candidate's error per group (lower is better)
    rank: torch.Tensor | None = None   # [B, G, P] what each parameter is ranked by; None: `error`

    def ranks(self, P: int) -> torch.Tensor:
        return self.error[..., None].expand(-1, -1, P) if self.rank is None else self.rank


Objective = Callable[[torch.Tensor], Scored]


def search(objective: Objective, mean: torch.Tensor, std: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           cfg: SearchCfg, say: Callable[[str], None] = print, label: str = "fit",
           show: Callable[[torch.Tensor], str] | None = None) -> torch.Tensor:
    """Cross-entropy steps from `mean` [G, P] with spread `std` (0: held), then the pattern
    search from where they ended: the best theta [G, P] found."""
    gen = torch.Generator().manual_seed(cfg.seed)
    best, std = cross_entropy(objective, mean, std, lo, hi, cfg.iterations, cfg, gen, say, label, show=show)
    return polish(objective, best, std, lo, hi, cfg.polish_steps, say, label, show=show)


def cross_entropy(objective: Objective, mean: torch.Tensor, std: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                  steps: int, cfg: SearchCfg, gen: torch.Generator, say: Callable[[str], None], label: str,
                  tie: tuple[int, int] | None = None, midway: Callable[[torch.Tensor], None] | None = None,
                  show: Callable[[torch.Tensor], str] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`steps` cross-entropy steps over the parameters with std > 0. `tie` (follower, leader):
    that parameter takes the other's sampled value. `midway(mean)` is called half way (the
    caller re-fits what it holds fixed, e.g. a latency); scores before it are then not
    compared with scores after. `show` formats the errors of the progress lines. Returns
    (each group's best-scored mean, the last std)."""
    show = show or _fmt
    free = std > 0
    P = mean.shape[-1]
    best, best_err = mean.clone(), torch.full((mean.shape[0],), math.inf)
    for it in range(steps):
        if midway is not None and it == steps // 2 and it > 0:
            midway(mean)
            best_err[:] = math.inf
        theta = mean + std * torch.randn(cfg.population, *mean.shape, generator=gen)
        theta[0] = mean
        if tie is not None:
            theta[..., tie[0]] = theta[..., tie[1]]
        theta = torch.maximum(torch.minimum(theta, hi), lo)
        scored = objective(theta)
        err = scored.error
        # Each group's best mean so far (the mean is candidate 0): a step of the search in many
        # coupled parameters can leave a group worse than the step before.
        better = err[0] < best_err
        best, best_err = torch.where(better[:, None], theta[0], best), torch.where(better, err[0], best_err)
        elite = torch.topk(scored.ranks(P), cfg.elites, dim=0, largest=False).indices   # [elites, G, P]
        picked = torch.gather(theta, 0, elite)
        mean, std = picked.mean(0), (picked.std(0) + 0.01 * (hi - lo)) * free
        say(f"{label}: step {it + 1}/{steps}, {show(err.amin(dim=0))} (best of the step)")
    return best, std


def polish(objective: Objective, mean: torch.Tensor, step: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
           steps: int, say: Callable[[str], None], label: str,
           show: Callable[[torch.Tensor], str] | None = None) -> torch.Tensor:
    """A pattern search from `mean` [G, P]: each parameter of every group moved one `step` up
    and down at once (1 + 2P candidates); each (group, parameter) keeps the best of its three
    and halves its step where staying put was best. The moves each (group, parameter) chose
    alone are taken together; where together they left a group worse than its best so far
    (coupled parameters), that group goes back to its best and halves its steps."""
    show = show or _fmt
    G, P = mean.shape
    step, best = step.clone(), mean.clone()
    best_err = torch.full((G,), math.inf)
    for k in range(steps + 1):
        n = 1 if k == steps else 1 + 2 * P                     # the last round only scores the last move
        theta = mean.expand(n, G, P).clone()
        for p in range(P if n > 1 else 0):
            theta[1 + 2 * p, :, p] += step[:, p]
            theta[2 + 2 * p, :, p] -= step[:, p]
        theta = torch.maximum(torch.minimum(theta, hi), lo)
        scored = objective(theta)
        err = scored.error
        worse = err[0] > best_err
        best = torch.where(worse[:, None], best, theta[0])
        best_err = torch.where(worse, best_err, err[0])
        if k == steps:
            break
        mean = best.clone()
        step = torch.where(worse[:, None], step / 2, step)
        rank = scored.ranks(P)                                               # [1 + 2P, G, P]
        for p in range(P):
            options = rank[[0, 1 + 2 * p, 2 + 2 * p], :, p]                  # [3, G]: stay, up, down
            pick = options.argmin(dim=0).masked_fill(worse, 0)
            mean[:, p] = theta[[0, 1 + 2 * p, 2 + 2 * p], :, p][pick, torch.arange(G)]
            step[:, p] = torch.where((pick == 0) & ~worse, step[:, p] / 2, step[:, p])
        say(f"{label}: polish {k + 1}/{steps}, {show(best_err)} (best so far)")
    return best


def _fmt(err: torch.Tensor) -> str:
    return "error per group " + " ".join(f"{float(e):.4g}" for e in err)
