"""``--optimizer qadam`` (or ``--bagua-base-optimizer qadam``): the optimizer half of Bagua's QAdam.

Only a name and its options; the math is :class:`bagua_integrations.optim.QAdam`. Train with
``--optimizer bagua_fused --bagua-base-optimizer qadam --bagua-algorithm qadam`` for the pair.
"""

import ast
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer
from omegaconf import II, OmegaConf

from bagua_integrations.optim import QAdam


@dataclass
class QAdamConfig(FairseqDataclass):
    qadam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for the QAdam optimizer"})
    qadam_eps: float = field(default=1e-8, metadata={"help": "epsilon for the QAdam optimizer"})
    qadam_warmup_steps: int = field(
        default=100, metadata={"help": "updates of plain Adam (full-precision communication) before v freezes"}
    )
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay (L2, or AdamW's with --qadam-decoupled-weight-decay)"})
    qadam_decoupled_weight_decay: bool = field(
        default=False, metadata={"help": "decay the weights directly, as AdamW, instead of an L2 term"}
    )
    lr: List[float] = II("optimization.lr")


@register_optimizer("qadam", dataclass=QAdamConfig)
class FairseqQAdam(FairseqOptimizer):
    def __init__(self, cfg: QAdamConfig, params):
        super().__init__(cfg)
        self._optimizer = QAdam(params, **self.optimizer_config)

    @property
    def optimizer_config(self):
        betas = self.cfg.qadam_betas
        return {
            "lr": self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr,
            "betas": tuple(ast.literal_eval(betas) if isinstance(betas, str) else OmegaConf.to_container(betas)
                           if OmegaConf.is_config(betas) else betas),
            "eps": self.cfg.qadam_eps,
            "warmup_steps": self.cfg.qadam_warmup_steps,
            "weight_decay": self.cfg.weight_decay,
            "decoupled_weight_decay": bool(self.cfg.qadam_decoupled_weight_decay),
        }

    @property
    def supports_flat_params(self):
        return True
