"""QUART's CV-propagation model (§5.2, Eq. 4–6): graph attention over the pipeline with a θ·CV term.

Nodes are stages; the neighbours of stage i are i−1, i and i+1 (a self-loop, as in GAT). For stage i
and neighbour j the attention logit is LeakyReLU(aᵀ[W x_i ‖ W x_j]) + θ·CV_j (Eq. 4). The paper writes
θ·CV_i, but a term that is the same for every neighbour cancels in the softmax; we add the
*neighbour's* CV so θ (learned) really weighs variable neighbours. x'_i = Σ_j α_ij W x_j (Eq. 5) and a
small readout f predicts CV̂_i (Eq. 6). The model forecasts the CV of each stage ``horizon``
windows ahead from the current per-stage features, so training pairs come straight from the
snapshot series the controller records. Until trained, the policy uses the observed CV.
Weights are saved as safetensors (never pickle).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from gateway_plugin.snapshot import PipelineSnapshot
from torch import nn

FEATURES = ("log_arrival_rate", "log_service_rate", "log_replicas", "log_queue_len", "utilisation", "cv_arrival")


def stage_features(snapshot: PipelineSnapshot) -> torch.Tensor:
    """[n_stages, len(FEATURES)] float32 features of one snapshot (log1p of rates and counts)."""
    rows = [
        [
            math.log1p(max(0.0, s.arrival_rate)),
            math.log1p(max(0.0, s.service_rate)),
            math.log1p(max(0, s.replicas)),
            math.log1p(max(0, s.queue_len)),
            min(1.5, max(0.0, s.utilisation)),
            min(20.0, max(0.0, s.cv_arrival)),
        ]
        for s in snapshot.stages
    ]
    return torch.tensor(rows, dtype=torch.float32)


def neighbour_mask(n: int) -> torch.Tensor:
    """[n, n] bool: j ∈ N(i) ⇔ |i − j| ≤ 1 (predecessor, self, successor)."""
    idx = torch.arange(n)
    return (idx[:, None] - idx[None, :]).abs() <= 1


class CVPropagationModel(nn.Module):
    """Graph attention with a learned θ·CV term and an MLP readout predicting each stage's CV."""

    def __init__(self, in_features: int = len(FEATURES), hidden: int = 16) -> None:
        super().__init__()
        self.W = nn.Linear(in_features, hidden, bias=False)
        self.a = nn.Parameter(torch.randn(2 * hidden) * 0.1)
        self.theta = nn.Parameter(torch.zeros(()))
        self.readout = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.leaky = nn.LeakyReLU(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [batch, n, F] or [n, F] → predicted CV [batch, n] or [n] (non-negative)."""
        squeeze = x.dim() == 2
        if squeeze:
            x = x.unsqueeze(0)
        n = x.shape[1]
        cv = x[..., FEATURES.index("cv_arrival")]  # [B, n]
        h = self.W(x)  # [B, n, H]
        hidden = h.shape[-1]
        left = h @ self.a[:hidden]  # [B, n]   aᵀ W x_i part
        right = h @ self.a[hidden:]  # [B, n]  aᵀ W x_j part
        logits = self.leaky(left[:, :, None] + right[:, None, :]) + self.theta * cv[:, None, :]
        logits = logits.masked_fill(~neighbour_mask(n).to(x.device), float("-inf"))
        alpha = torch.softmax(logits, dim=-1)  # Eq. 4
        aggregated = alpha @ h  # Eq. 5
        out = nn.functional.softplus(self.readout(torch.cat([aggregated, h], dim=-1))).squeeze(-1)  # Eq. 6
        return out.squeeze(0) if squeeze else out

    @torch.no_grad()
    def predict(self, snapshot: PipelineSnapshot) -> list[float]:
        self.eval()
        return [float(v) for v in self(stage_features(snapshot))]


def training_pairs(series: Sequence[PipelineSnapshot], horizon: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(features at t, observed CV at t + horizon) for every t of one model's snapshot series."""
    if len(series) <= horizon:
        raise ValueError(f"need more than {horizon} snapshots to train, got {len(series)}")
    n = len(series[0].stages)
    if any(len(s.stages) != n for s in series):
        raise ValueError("all snapshots of a training series must have the same number of stages")
    xs = torch.stack([stage_features(s) for s in series[:-horizon]])
    ys = torch.tensor([[st.cv_arrival for st in s.stages] for s in series[horizon:]], dtype=torch.float32)
    return xs, ys.clamp(0.0, 20.0)


def train_cv_model(
    series: Sequence[PipelineSnapshot],
    horizon: int = 1,
    epochs: int = 300,
    lr: float = 0.01,
    hidden: int = 16,
    seed: int = 0,
) -> tuple[CVPropagationModel, float]:
    """Fit a model on a snapshot series; returns (model, final mean-squared error on the series)."""
    torch.manual_seed(seed)
    xs, ys = training_pairs(series, horizon)
    model = CVPropagationModel(xs.shape[-1], hidden)
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    loss = torch.tensor(0.0)
    model.train()
    for _ in range(epochs):
        optimiser.zero_grad()
        loss = nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        optimiser.step()
    model.eval()
    return model, float(loss.detach())


def save_cv_model(model: CVPropagationModel, path: str) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path, metadata={"hidden": str(model.W.out_features)})


def load_cv_model(path: str) -> CVPropagationModel:
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as f:
        hidden = int((f.metadata() or {}).get("hidden", "16"))
    model = CVPropagationModel(len(FEATURES), hidden)
    model.load_state_dict(load_file(path))
    model.eval()
    return model


def main(argv: list[str] | None = None) -> int:
    """``python -m gateway_plugin.policies.cv_model --log control.jsonl --out cv.safetensors``: train the
    CV-propagation model on the snapshots the controller logged (QUART_CONTROL_LOG), one model per run."""
    import argparse
    import json
    import sys

    from gateway_plugin.snapshot import snapshot_from_json

    p = argparse.ArgumentParser(prog="python -m gateway_plugin.policies.cv_model", description=main.__doc__)
    p.add_argument("--log", required=True, help="controller JSONL log (QUART_CONTROL_LOG)")
    p.add_argument("--model", default=None, help="pipeline to train on (default: the first in the log)")
    p.add_argument("--out", required=True, help="safetensors file to write (QUART_CV_MODEL)")
    p.add_argument("--horizon", type=int, default=1, help="predict this many control periods ahead")
    p.add_argument("--epochs", type=int, default=300)
    args = p.parse_args(argv)
    series = []
    with open(args.log) as fh:
        for line in fh:
            if line.strip():
                snap = snapshot_from_json(json.loads(line)["snapshot"])
                if args.model is None:
                    args.model = snap.model
                if snap.model == args.model:
                    series.append(snap)
    try:
        model, loss = train_cv_model(series, horizon=args.horizon, epochs=args.epochs)
    except ValueError as exc:
        print(f"cv_model: {exc}", file=sys.stderr)
        return 2
    save_cv_model(model, args.out)
    print(json.dumps({"model": args.model, "snapshots": len(series), "mse": loss, "theta": float(model.theta.detach()),
                      "out": args.out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
