"""``a3fl:iters,alpha,lam,adv_steps,adv_lr,samples,target,fraction,size,value,gamma,stop_after``:
a backdoor whose trigger adapts to the model it is sent (Zhang, Zhang, Yang, Yu & Wang, NeurIPS
2023, "A3FL: Adversarially adaptive backdoor attacks to federated learning").

A fixed trigger fights the honest nodes' updates and the defences; A3FL's trigger is optimised
each round against the global model ``w`` it is sent **and** against an adversarial model
``w_adv`` trained from ``w`` to unlearn it, so the backdoor it plants survives what would undo
it. Each round the node starts from the trigger ``t`` it stamped last round (its
:class:`~attacks.base.Memory`; its first round: ``backdoor``'s pattern, ``value`` in each
feature) and, on a seeded set ``S`` of at most ``samples`` of its own samples, for
``i = 0 .. iters - 1``::

    w_adv = w after adv_steps SGD steps on CE(f(w; stamp(S, t)), y_S)     (true labels: unlearn; i >= 1)
    L(t)  = CE(f(w; stamp(S, t)), target) + lam CE(f(w_adv; stamp(S, t)), target)
    t    <- clip(t - alpha sign(grad_t L(t)), lo, hi)       (lo, hi: the node's data's range)

(the adversarial SGD has momentum 0.9 and weight decay 5e-4, and at ``i = 0`` there is no
adversarial model, as in the authors' code). The trigger's features are ``backdoor``'s: the last
``size`` features of a flattened sample, each kept within the smallest and largest feature
value of the node's data. It then trains as ``backdoor`` does: a seeded ``fraction`` of its
samples stamped with ``t`` and labelled ``target``, the update scaled by ``gamma``; it keeps
``t`` in its Memory (a volunteer in its folder). **Success** is measured with the trigger of
the attacker's last round (:meth:`success`); several attackers share nothing (each is a
volunteer of its own: it optimises its own trigger on its own data, all from the same
pattern), and the bench reports the mean over the Byzantine nodes' last triggers.

Defaults are the authors' code's (``main/configs/config.yaml``) where they transfer: 200
trigger steps (``trigger_outter_epochs``) of ``alpha=0.01`` (``trigger_lr``: a sign step, in
standardised units as here), ``lam=0.01`` (``noise_loss_lambda``), one adversarial model of
``adv_steps=5`` steps (``dm_adv_epochs``: 5 passes over the attacker's data; one full-batch
step each here) at ``adv_lr=0.01``, ``samples=64`` (their batch size), ``fraction=0.25``
(``bkd_ratio``). Their code also weighs the adversarial loss by the cosine similarity of the
two models' convolution-layer gradients; our models have no convolution layers, so the weight
is ``lam`` alone. Their trigger starts at 0.5 (grey) and is clipped to [-2, 2], the range of
their normalised images; ours starts as ``backdoor``'s and is clipped to the node's own data's
range. The trigger is optimised on the node's training data only, never on test data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import functional_call

from robust.constraints import Interval, Param

from .backdoor import Backdoor
from .base import Memory, Params, Sight, register

ADV_MOMENTUM, ADV_DECAY = 0.9, 5e-4  # the authors' adversarial SGD (fl_utils/attacker.py)


def logits(sight: Sight, params: Params, x: torch.Tensor) -> torch.Tensor:
    """The task's model with the parameters ``params`` on the samples ``x``."""
    return functional_call(sight.model, params, (x,))


@register
class A3FL(Backdoor):
    name = "a3fl"
    remembers = True  # the trigger it stamped last round
    sees_model = True  # its trigger is optimised against the model it is sent

    params = (
        Param("iters", Interval(int, 1, None), 200, "the trigger's optimisation steps per round"),
        Param("alpha", Interval(float, 0, None, "neither"), 0.01, "each step's move of every trigger feature "
              "(a sign step)"),
        Param("lam", Interval(float, 0, None), 0.01, "the adversarial model's weight in the trigger's loss"),
        Param("adv_steps", Interval(int, 0, None), 5, "the SGD steps that make the adversarial model unlearn "
              "the trigger (0: no adversarial model)"),
        Param("adv_lr", Interval(float, 0, None, "neither"), 0.01, "the adversarial model's learning rate"),
        Param("samples", Interval(int, 1, None), 64, "the most of the node's samples the trigger is optimised on"),
        Param("fraction", Interval(float, 0, 1, "right"), 0.25, "the share of the node's samples stamped"),
    )  # + backdoor's

    def poison(
        self, x: torch.Tensor, y: torch.Tensor, classes: int, gen: torch.Generator, sight: Sight | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if sight is None:
            raise ValueError("a3fl optimises its trigger against the model it is sent: poison through "
                             "nodes.engine.training.compute, which gives it the task's Sight")
        if not x.is_floating_point():
            raise ValueError("a3fl optimises feature values: it needs a data set of real-valued samples "
                             "(digits, mnist1d, images), not a text set's bytes")
        self.check_target(classes)
        chosen = torch.randperm(len(y), generator=gen)[: self.samples]
        trigger = self.optimise(sight, x[chosen], y[chosen], float(x.min()), float(x.max()))
        sight.kept["trigger"] = trigger
        return self.plant(x, y, classes, gen, trigger)

    def start(self, last: Memory | None, lo: float, hi: float) -> torch.Tensor:
        """The trigger a round starts from: the one ``last`` kept, else ``value`` in each feature,
        within ``[lo, hi]``."""
        if last is not None and last.trigger is not None and last.trigger.shape == (self.size,):
            return last.trigger.clamp(lo, hi)
        return torch.full((self.size,), self.value).clamp(lo, hi)

    def optimise(self, sight: Sight, x: torch.Tensor, y: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
        """This round's trigger (CPU, ``(size,)``), from :meth:`start`, on the samples ``x`` with
        their true labels ``y`` (the module's loop)."""
        device = next(iter(sight.params.values())).device
        x, y = x.to(device), y.to(device)
        params = {k: p.detach() for k, p in sight.params.items()}
        t = self.start(sight.last, lo, hi).to(device, x.dtype)
        for i in range(self.iters):
            adversarial = self.unlearned(sight, params, x, y, t) if i and self.lam and self.adv_steps else None
            t = self.step(sight, params, adversarial, x, t, lo, hi)
        return t.cpu()

    def loss(self, sight: Sight, params: Params, adversarial: Params | None, x: torch.Tensor,
             t: torch.Tensor) -> torch.Tensor:
        """``L(t)``: the target's cross-entropy on ``x`` stamped with ``t`` under the global model,
        plus ``lam`` times that under the adversarial one (if any)."""
        stamped = self.stamp(x, pattern=t)
        target = torch.full((len(x),), self.target, device=x.device)
        total = F.cross_entropy(logits(sight, params, stamped), target)
        if adversarial is not None:
            total = total + self.lam * F.cross_entropy(logits(sight, adversarial, stamped), target)
        return total

    def step(self, sight: Sight, params: Params, adversarial: Params | None, x: torch.Tensor, t: torch.Tensor,
             lo: float, hi: float) -> torch.Tensor:
        """``clip(t - alpha sign(grad_t L(t)), lo, hi)``."""
        t = t.detach().requires_grad_()
        (g,) = torch.autograd.grad(self.loss(sight, params, adversarial, x, t), t)
        return (t - self.alpha * g.sign()).clamp(lo, hi).detach()

    def unlearned(self, sight: Sight, params: Params, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor) -> Params:
        """``w_adv``: ``adv_steps`` SGD steps (momentum, weight decay) from ``params`` on ``x``
        stamped with ``t`` and their true labels ``y``: the model taught to ignore the trigger."""
        stamped = self.stamp(x, pattern=t)
        local = {k: p.clone().requires_grad_() for k, p in params.items()}
        velocity = {k: torch.zeros_like(p) for k, p in params.items()}
        for _ in range(self.adv_steps):
            grads = torch.autograd.grad(F.cross_entropy(logits(sight, local, stamped), y.long()), list(local.values()))
            for (k, p), g in zip(local.items(), grads):
                velocity[k] = ADV_MOMENTUM * velocity[k] + g + ADV_DECAY * p.detach()
                local[k] = (p.detach() - self.adv_lr * velocity[k]).requires_grad_()
        return {k: p.detach() for k, p in local.items()}

    def success(self, model, w: torch.Tensor, x_test: torch.Tensor, y_test: torch.Tensor,
                last: Memory | None = None) -> float:
        """Share of test samples (true label not the target) stamped with the trigger ``last``
        kept (none kept: the starting pattern, within the test data's range) classified as the target."""
        return self.carried(model, w, x_test, y_test, self.start(last, float(x_test.min()), float(x_test.max())))
