"""The training configuration: a few typed, frozen dataclasses that check themselves.

Each field carries its flag (:mod:`tandem.config_fields`); the resolved config is written to
``OUT/config.json`` and every checkpoint. ``batch_size`` is the **global** batch; one optimizer
step consumes ``accum_steps`` of them; ``max_steps`` stops early, the schedule unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tandem.data.dataset import parse_augment
from tandem.data.device_decode import DECODE_MODES
from tandem.data.mixing import Mixing
from tandem.errors import TandemError, UsageError, param
from tandem.keyed import DROPOUT_RNGS, KEYED
from tandem.optim import CLIP_MODES, EXCLUDES_NORM, LR_SCALES, OPTIMIZERS
from tandem.suggest import did_you_mean
from tandem.config_fields import (FIXED, MAY_CHANGE, PER_CALL, check, check_choice, check_type,
                                  flag_of, opt)
from tandem.config_parallel import DTYPES, ParallelConfig

SCHEDULES = ("cosine", "step", "constant")

NO_WEIGHTS_FILE = (f"{param('pretrained')} needs a FILE: tandem never downloads weights; save "
                   "a torchvision state dict (e.g. resnet18-f37072fd.pth) or a checkpoint and "
                   f"pass {param('pretrained')} FILE (alias --weights FILE)")


@dataclass(frozen=True)
class ModelConfig:
    arch: str = opt("cifar_resnet20", "model architecture (see `tandem models`), or "
                    "package.module:function building your own (called with num_classes= and "
                    "in_channels= when it takes them) (default: cifar_resnet20; for an "
                    "ImageFolder directory resnet18, as in the imagenet example)",
                    "-a", "--arch", metavar="ARCH")
    dropout: float | None = opt(None, "dropout probability for models with dropout "
                                "(default: the model's own)", metavar="P")
    dropout_rng: str = opt(KEYED, "where dropout and drop path draw their masks in training: "
                           "keyed (default) draws each sample's from a stream keyed by the "
                           "seed, the step and the sample's place in the global batch, so "
                           "every strategy and device count computes the same run; torch "
                           "draws from torch's generator, as torch's layers do",
                           choices=DROPOUT_RNGS)
    drop_path: float = opt(0.0, "stochastic depth for the zoo's ResNets: the last residual "
                           "block's branch is dropped with probability P, earlier ones "
                           "linearly less, the first never, as in timm; 0: none", metavar="P")
    pretrained: str | None = opt(None, "start from these weights: a torchvision state-dict file "
                                 "or a checkpoint; nothing is downloaded (a classifier of "
                                 "another size is re-initialised)", "--pretrained", "--weights",
                                 metavar="FILE", on_resume=PER_CALL, nargs="?", const="",
                                 per_node=True)
    output_key: str | None = opt(None, "the logits in a model that returns a dict (its key) or a "
                                 "tuple (its index)", metavar="KEY")
    hybrid_head: str | None = opt(None, "hybrid: the attribute holding the Linear head to split "
                                  "(default: classifier, else fc)", metavar="ATTR")

    def __post_init__(self):
        check(bool(self.arch), f"{param('arch')} must not be empty")
        check(self.pretrained != "", NO_WEIGHTS_FILE)
        check(self.dropout is None or 0.0 <= self.dropout < 1.0,
               f"bad {param('dropout')} {self.dropout}: must be in [0, 1)")
        check_choice(self.dropout_rng, DROPOUT_RNGS, "dropout_rng")
        check(0.0 <= self.drop_path < 1.0,
              f"bad {param('drop_path')} {self.drop_path}: must be in [0, 1)")
        check(self.output_key != "", f"{param('output_key')} must not be empty")
        check(self.hybrid_head != "", f"{param('hybrid_head')} must not be empty")


@dataclass(frozen=True)
class DataConfig:
    data: str = opt("digits", "dataset: synthetic, digits, an ImageFolder directory, a "
                    "CIFAR-10 python directory, or package.module:function returning your own "
                    "(train, val[, class_names]). An ImageFolder without train/ and val/ is split "
                    "80/20 per class by a fixed shuffle, the same whatever --seed (one line "
                    "says so)", metavar="NAME|DIR", per_node=True)
    augment: str = opt("auto", "training augmentation. auto (default): imagenet for an ImageFolder "
                       "directory, standard for digits, synthetic and CIFAR-10; standard: random "
                       "shifts (and flips where the data allows); imagenet: RandomResizedCrop + "
                       "flip (ImageFolder only); none; randaugment:N:M: auto's, then timm's "
                       "RandAugment, N operations of magnitude M (0 to 10), e.g. randaugment:2:9; "
                       "trivialaugment: auto's, then TrivialAugment Wide. Drawn per sample: the "
                       "same images on any devices", metavar="MODE")
    reprob: float = opt(0.0, "random erasing (timm's, pixel mode): the probability that a "
                        "training image gets a box of noise", metavar="P")
    mixup: float = opt(0.0, "mixup: Beta(A, A)'s alpha, drawn for each global batch (0: off; "
                       "e.g. 0.2 or 0.8). Targets become class probabilities (label smoothing "
                       "applies to them); training accuracy counts the dominant label", metavar="A")
    cutmix: float = opt(0.0, "cutmix: Beta(A, A)'s alpha for the pasted box's share (0: off; "
                        "e.g. 1.0); with --mixup, each mixed batch is one or the other",
                        metavar="A")
    mix_prob: float = opt(1.0, "with --mixup or --cutmix: the probability that a global batch "
                          "is mixed", metavar="P")
    mix_switch_prob: float = opt(0.5, "with --mixup and --cutmix: the probability that a "
                                 "mixed batch is cutmix rather than mixup", metavar="P")
    image_size: int | None = opt(None, "resize images to this side (default: for an "
                                 "ImageFolder the arch's native size, e.g. 224 crops with "
                                 "resize 256 + centre crop 224 for validation, or the shorter "
                                 "side under a package.module:function model; else the "
                                 "dataset's own)", metavar="PX")
    num_classes: int | None = opt(None, "classes the model outputs; real data needs at least "
                                  "its own (e.g. 1000 keeps the imagenet example's head); "
                                  "synthetic data makes that many (default: the data's, or a "
                                  "resumed file's larger classifier)", metavar="N")
    synthetic_size: int | None = opt(None, "samples in the synthetic dataset", metavar="N")
    workers: int = opt(0, "data loading worker processes (seeded)", "-j", "--workers",
                       metavar="N", on_resume=MAY_CHANGE, per_node=True)
    decode: str = opt("auto", "where ImageFolder JPEGs are decoded: gpu (the workers read the "
                      "files and draw the crops; nvJPEG decodes each batch on the CUDA device, "
                      "which crops and resizes it; needs torchvision), cpu (the workers decode), "
                      "or auto (default: gpu on a CUDA device when torchvision is installed, "
                      "else cpu)", choices=DECODE_MODES, on_resume=MAY_CHANGE, per_node=True)

    def __post_init__(self):
        check(bool(self.data), f"{param('data')} must not be empty")
        parse_augment(self.augment, self.reprob)  # one line for a bad value
        self.mixing()
        for name in ("image_size", "num_classes", "synthetic_size"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"bad {param(name)} {value}: must be >= 1")
        check(self.workers >= 0, f"bad {param('workers')} {self.workers}: must be >= 0")
        check_choice(self.decode, DECODE_MODES, "decode")

    def mixing(self, num_classes: int = 1) -> Mixing | None:
        """The run's mixup and cutmix over ``num_classes`` (checked), or None when off."""
        mixing = Mixing(self.mixup, self.cutmix, self.mix_prob, self.mix_switch_prob, num_classes)
        return mixing if mixing.active else None


@dataclass(frozen=True)
class OptimConfig:
    epochs: int = opt(30, "number of epochs (the learning-rate schedule spans them)",
                      metavar="N", on_resume=MAY_CHANGE)
    batch_size: int = opt(32, "GLOBAL batch size, over all devices and processes",
                          "-b", "--batch-size", metavar="N")
    lr: float = opt(0.05, "initial learning rate, the schedule's peak (with --lr-scale: at "
                    "--lr-base-batch images per step)", "--lr", "--learning-rate", metavar="LR")
    optimizer: str = opt("sgd", "optimizer: sgd (momentum, --nesterov: the imagenet "
                         "example's), adamw (torch's AdamW), lars (You et al. 2017: SGD with a "
                         "trust ratio per layer) or lamb (You et al. 2019: Adam with one); "
                         "see the recipes guide", "--opt", choices=OPTIMIZERS)
    momentum: float = opt(0.9, "momentum of sgd and lars", metavar="M")
    weight_decay: float = opt(5e-4, "weight decay (adamw, lamb: decoupled from the gradient)",
                              "--wd", "--weight-decay", metavar="W")
    wd_exclude_norm: str | None = opt(None, "no weight decay on biases and normalisation "
                                      "weights (parameters of one dimension), and no lars or "
                                      "lamb trust ratio there (default: on for adamw, lars and "
                                      "lamb, as timm; off for sgd, as the imagenet example)",
                                      choices=("on", "off"))
    nesterov: bool = opt(False, "Nesterov momentum (SGD)")
    opt_eps: float | None = opt(None, "epsilon of adamw and lamb (in the denominator of "
                                "Adam's step) and of lars (in its trust ratio's) (default: "
                                "1e-8; lamb 1e-6)", metavar="EPS")
    opt_betas: str | None = opt(None, "adamw's and lamb's moment decays (default: 0.9,0.999)",
                                metavar="B1,B2")
    lars_trust: float = opt(0.001, "lars: the trust coefficient, the fraction of a layer's "
                            "weight norm that one step moves it by at lr 1 (You et al.'s eta)",
                            metavar="ETA")
    clip_grad: float | None = opt(None, "clip gradients: by the norm of the whole model's "
                                  "gradient (every strategy's blocks and processes counted), "
                                  "or by value with --clip-mode value", metavar="NORM")
    clip_mode: str = opt("norm", "with --clip-grad: norm (scale every gradient so that the "
                         "total norm is at most NORM) or value (clamp each element to "
                         "[-NORM, NORM])", choices=CLIP_MODES)
    model_ema: float | None = opt(None, "keep an exponential moving average of the weights "
                                  "and buffers with this decay (e.g. 0.9998), validated each "
                                  "epoch beside them and saved in checkpoints; best.pt goes "
                                  "by its score (tandem eval --ema)", metavar="DECAY")
    model_ema_warmup: bool = opt(True, "without --model-ema's warm-up of the decay (timm's: "
                                 "1-(1+n)^(-2/3) until it reaches DECAY)", "--no-model-ema-warmup")
    lr_scale: str = opt("none", "scale --lr with the images per optimizer step (global batch x "
                        "--accum-steps) over --lr-base-batch: linear (Goyal et al. 2017), sqrt, "
                        "or none", choices=LR_SCALES)
    lr_base_batch: int = opt(256, "with --lr-scale: the images per step --lr is given for",
                             metavar="N")
    lr_schedule: str = opt("cosine", "learning-rate schedule, stepped every optimizer step",
                           choices=SCHEDULES)
    lr_step: float = opt(30.0, "step schedule: epochs between decays", metavar="EPOCHS")
    lr_gamma: float = opt(0.1, "step schedule: decay factor", metavar="G")
    warmup_epochs: float = opt(0.0, "linear learning-rate warm-up, in epochs", metavar="EPOCHS")
    label_smoothing: float = opt(0.1, "cross-entropy label smoothing", metavar="E")
    ignore_index: int = opt(-100, "target value the loss and the scores skip (e.g. 255 for "
                            "segmentation borders)", metavar="I")
    accum_steps: int = opt(1, "global batches per optimizer step (gradient accumulation)",
                           metavar="K")
    max_steps: int | None = opt(None, "stop this invocation once the run has made N optimizer "
                                "steps in all, then validate and save", metavar="N",
                                on_resume=PER_CALL)

    def __post_init__(self):
        check(self.epochs >= 1, f"bad {param('epochs')} {self.epochs}: must be >= 1")
        check(self.batch_size >= 1, f"bad {param('batch_size')} {self.batch_size}: must be >= 1")
        check(self.lr > 0, f"bad {param('lr')} {self.lr}: must be > 0")
        check(0 <= self.momentum < 1, f"bad {param('momentum')} {self.momentum}: must be in [0, 1) "
               f"(e.g. 0.9; at 1 or more the steps never decay)")
        check(self.weight_decay >= 0,
              f"bad {param('weight_decay')} {self.weight_decay}: must be >= 0")
        check(not self.nesterov or self.momentum > 0,
               f"{param('nesterov')} needs a {param('momentum')} above 0, not {self.momentum}")
        self._check_optimizer()
        self._check_recipe()
        check_choice(self.lr_schedule, SCHEDULES, "lr_schedule")
        check(self.lr_step > 0, f"bad {param('lr_step')} {self.lr_step}: must be > 0")
        check(self.lr_gamma > 0, f"bad {param('lr_gamma')} {self.lr_gamma}: must be > 0")
        check(self.warmup_epochs >= 0,
              f"bad {param('warmup_epochs')} {self.warmup_epochs}: must be >= 0")
        check(0.0 <= self.label_smoothing < 1.0,
               f"bad {param('label_smoothing')} {self.label_smoothing}: must be in [0, 1)")
        check(self.accum_steps >= 1, f"bad {param('accum_steps')} {self.accum_steps}: must be >= 1")
        check(self.max_steps is None or self.max_steps >= 1,
               f"bad {param('max_steps')} {self.max_steps}: must be >= 1")

    def _check_optimizer(self) -> None:
        """``--opt`` and the settings that belong to some optimizers only."""
        name = self.optimizer
        close = did_you_mean(name, list(OPTIMIZERS)).removeprefix(": ")
        check(name in OPTIMIZERS, f"bad {param('optimizer')} {name!r}: choose one of "
                                  f"{', '.join(OPTIMIZERS)}" + (f" ({close})" if close else ""))
        check(not self.nesterov or name == "sgd",
              f"{param('nesterov')} is sgd's; {param('optimizer')} {name} has none")
        check(self.opt_eps is None or name != "sgd",
              f"{param('opt_eps')} is adamw's, lars' and lamb's; sgd has none")
        check(self.opt_eps is None or self.opt_eps > 0,
              f"bad {param('opt_eps')} {self.opt_eps}: must be > 0")
        if self.opt_betas is not None:
            check(name in ("adamw", "lamb"), f"{param('opt_betas')} are adamw's and lamb's; "
                                             f"{param('optimizer')} {name} has none")
            self.betas()  # its check
        check(self.lars_trust > 0, f"bad {param('lars_trust')} {self.lars_trust}: must be > 0")
        if self.wd_exclude_norm is not None:
            check_choice(self.wd_exclude_norm, ("on", "off"), "wd_exclude_norm")

    def _check_recipe(self) -> None:
        """Clipping, the EMA and the lr's scaling."""
        check(self.clip_grad is None or self.clip_grad > 0,
              f"bad {param('clip_grad')} {self.clip_grad}: must be > 0 (e.g. 1.0)")
        check_choice(self.clip_mode, CLIP_MODES, "clip_mode")
        check(self.model_ema is None or 0 < self.model_ema < 1,
              f"bad {param('model_ema')} {self.model_ema}: the decay must be in (0, 1), "
              f"e.g. 0.9998")
        check_choice(self.lr_scale, LR_SCALES, "lr_scale")
        check(self.lr_base_batch >= 1,
              f"bad {param('lr_base_batch')} {self.lr_base_batch}: must be >= 1")

    def betas(self) -> tuple[float, float]:
        """``--opt-betas`` as two floats (default 0.9, 0.999), each in [0, 1)."""
        if self.opt_betas is None:
            return (0.9, 0.999)
        try:
            values = tuple(float(p) for p in self.opt_betas.split(","))
        except ValueError:
            values = ()
        check(len(values) == 2 and all(0 <= b < 1 for b in values),
              f"bad {param('opt_betas')} {self.opt_betas!r}: two decays in [0, 1), e.g. 0.9,0.999")
        return values

    def excludes_norm(self) -> bool:
        """``--wd-exclude-norm`` resolved: as given, else on for adamw, lars and lamb (timm)."""
        if self.wd_exclude_norm is None:
            return self.optimizer in EXCLUDES_NORM
        return self.wd_exclude_norm == "on"


@dataclass(frozen=True)
class RunConfig:
    out: str = opt("runs/train", "run directory (checkpoints, metrics, curves); with --resume: "
                   "the resumed run's own directory unless given", metavar="DIR",
                   on_resume=PER_CALL, per_node=True)
    seed: int = opt(0, "seed for model init, data order and augmentation", metavar="S")
    resume: str | None = opt(None, "continue the run in RUN (a run directory or its "
                             "checkpoint.pt) with its own settings", metavar="RUN",
                             on_resume=PER_CALL, per_node=True)
    overwrite: bool = opt(False, "let a fresh run replace the run already in --out",
                          on_resume=PER_CALL)
    save_every: int | None = opt(None, "also save checkpoint.pt every N optimizer steps "
                                 "(default: at the end of each epoch only)", metavar="N",
                                 on_resume=MAY_CHANGE)
    save_minutes: float | None = opt(None, "also save checkpoint.pt after every M minutes of "
                                     "training, 0 for never (default: 10 under several "
                                     "processes, where a lost machine can cost every step "
                                     "since the last checkpoint; else 0)", metavar="M",
                                     on_resume=MAY_CHANGE)
    evaluate: bool = opt(False, "only validate (the --resume checkpoint, if given)",
                         "-e", "--evaluate", on_resume=PER_CALL)
    no_progress: bool = opt(False, "no progress bar (epoch summaries are still printed)",
                            on_resume=MAY_CHANGE, per_node=True)
    print_freq: int = opt(0, "without a progress bar, print a line every N steps (0: never)",
                          "-p", "--print-freq", metavar="N", on_resume=MAY_CHANGE)

    def __post_init__(self):
        check(bool(self.out), f"{param('out')} must not be empty")
        check(self.print_freq >= 0, f"bad {param('print_freq')} {self.print_freq}: must be >= 0")
        check(self.save_every is None or self.save_every >= 1,
               f"bad {param('save_every')} {self.save_every}: must be >= 1")
        check(self.save_minutes is None or self.save_minutes >= 0,
              f"bad {param('save_minutes')} {self.save_minutes}: must be >= 0 minutes")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig,
            "parallel": ParallelConfig, "run": RunConfig}


def flag_for(name: str) -> str:
    """The flag that names parameter ``name``: a config field's long flag spelt like the field
    (``--weight-decay``, not ``--wd``), else its first long flag; any other parameter the flag
    its name makes (``nproc_per_node``: ``--nproc-per-node``)."""
    own = "--" + name.replace("_", "-")
    for section in SECTIONS.values():
        for f in dataclasses.fields(section):
            if f.name == name:
                flags = [flag for flag in flag_of(f) if flag.startswith("--")]
                return own if own in flags else flags[0]
    return own


def flagged(exc: BaseException) -> str:
    """``exc``'s message with each parameter named by its flag (:func:`flag_for`)."""
    return exc.worded(flag_for) if isinstance(exc, TandemError) else str(exc)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one ``tandem train`` run needs, grouped by concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        """Plain nested dict of str/int/float/bool/None (JSON- and weights_only-safe)."""
        return dataclasses.asdict(self)

    def settings(self) -> dict:
        """:meth:`to_dict` without the ``PER_CALL`` fields (``--max-steps``, ``--out``): the
        run's own settings, as ``config.json`` and checkpoints keep them."""
        saved = self.to_dict()
        for name, section in SECTIONS.items():
            for f in dataclasses.fields(section):
                if f.metadata.get("on_resume", FIXED) == PER_CALL:
                    del saved[name][f.name]
        return saved

    def job_settings(self) -> dict:
        """``{"optim.lr": 0.01, ...}``: every field the ranks of a job must agree on."""
        return {f"{name}.{f.name}": getattr(getattr(self, name), f.name)
                for name, section in SECTIONS.items() for f in dataclasses.fields(section)
                if not f.metadata.get("per_node")}

    @classmethod
    def from_settings(cls, settings: dict, caller: str = "tandem.fit()") -> "TrainConfig":
        """Build from flat field names (``batch_size=64``), checked as from the command line;
        an unknown name is an error suggesting close ones."""
        where = {f.name: name for name, section in SECTIONS.items()
                 for f in dataclasses.fields(section)}
        values: dict[str, dict] = {name: {} for name in SECTIONS}
        for key, value in settings.items():
            if key not in where:
                hint = did_you_mean(key, list(where)) or \
                    " (the settings are the `tandem train` flags' names, e.g. batch_size)"
                raise UsageError(f"{caller} got an unknown setting {key!r}{hint}")
            check_type(SECTIONS[where[key]], key, value)
            values[where[key]][key] = value
        return cls(**{name: SECTIONS[name](**v) for name, v in values.items()})

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        """Rebuild from :meth:`to_dict` output; unknown keys (older/newer files) are ignored."""
        known = {name: {f.name for f in dataclasses.fields(s)} for name, s in SECTIONS.items()}
        return cls(**{name: section(**{k: v for k, v in (data.get(name) or {}).items()
                                       if k in known[name]})
                      for name, section in SECTIONS.items()})
