"""Which normalization to use: the selection guide of the source articles, as a rule table.

:func:`recommend` answers "which norm for this architecture at this per-device batch
size?" from two tables, so the advice can be read, tested and cited row by row:

* :data:`RULES`: ``(When, Choice)`` rows; the **first** row whose conditions match picks
  the family, its alternatives and the reasons.
* :data:`NOTES`: ``(When, text)`` rows; **every** matching row adds a caution (they may
  also condition on the chosen family).

Sources, cited in the rows:

* 《深度学习归一化技术：BN与LN原理及应用对比》 (*Deep-learning normalization: BN vs LN,
  principles and applications*): the BN/LN comparison table (§4.1), the selection guide
  (§4.2: CNN → BN, RNN/Transformer → LN; BN at batch ≥ 32, LN for small batches or
  online learning), initialization γ = 1, β = 0 (§5.1), "validation accuracy drops
  suddenly: suspect BN's running statistics; validate in eval mode" (§5.2).
* 《归一化那些事》 (*All about normalization*): BN depends on the batch and suits
  neither tiny batches nor RNNs; LN per time step for RNN/LSTM; weight normalization
  for recurrent and noise-sensitive models (reinforcement learning).
* Wu & He 2018 (Group Normalization): ResNet-50 ImageNet error at 32/16/8/4/2 images
  per GPU: BN 23.6/23.7/24.8/27.3/34.7 %, GN 24.1/24.2/24.0/24.2/24.1 %.
* Ba, Kiros & Hinton 2016 (Layer Normalization); Zhang & Sennrich 2019 (RMSNorm: 7–64 %
  less running time than LN at equal quality); Ulyanov, Vedaldi & Lempitsky 2016
  (Instance Normalization for style transfer); Ioffe 2017 (Batch Renormalization).
"""

from __future__ import annotations

import numbers
import textwrap
from dataclasses import dataclass

import torch

__all__ = [
    "Recommendation", "recommend", "When", "Choice", "RULES", "NOTES",
    "ARCHITECTURES", "TASKS", "FAMILIES", "BN_MIN_BATCH",
]

#: Per-device batch size from which BatchNorm is the first choice for CNNs and MLPs
#: (《深度学习归一化技术：BN与LN原理及应用对比》 §2.3 and §4.2: "batch size 一般建议至少为32";
#: Wu & He 2018: BN 23.6 % vs GN 24.1 % error at 32 images per GPU).
BN_MIN_BATCH = 32

#: Accepted ``architecture`` values (case-insensitive). "lstm" and "gru" mean "rnn";
#: "gan" and "style" mean an image generator / style-transfer network.
ARCHITECTURES = ("cnn", "mlp", "rnn", "lstm", "gru", "transformer", "gan", "style")

#: Accepted ``task`` values (case-insensitive, ``_`` or spaces for ``-``).
TASKS = ("classification", "detection", "segmentation", "fine-tuning", "language-model",
         "speech", "style-transfer", "reinforcement-learning")

_ARCH_GROUP = {"lstm": "rnn", "gru": "rnn", "gan": "style"}
_TASK_ALIASES = {"finetuning": "fine-tuning", "finetune": "fine-tuning",
                 "fine-tune": "fine-tuning", "rl": "reinforcement-learning",
                 "style": "style-transfer", "lm": "language-model"}

#: Family name -> (display name, how to get it in normkit). The names that are also
#: registry names (``bn``, ``gn``, ``ln``, ``ln2d``, ``rms``, ``in``) go straight to
#: :func:`normkit.get_norm_layer`; the others are model-level conversions or classes.
FAMILIES: dict[str, tuple[str, str]] = {
    "bn": ("BatchNorm", "normkit.get_norm_layer('bn', C) (BatchNorm2d; 'bn1d' for (N, C))"),
    "syncbn": ("SyncBatchNorm", "normkit.convert_sync_batchnorm(model)"),
    "batchrenorm": ("Batch Renormalization", "normkit.BatchRenorm2d(C)"),
    "frozenbn": ("FrozenBatchNorm", "normkit.freeze_batchnorm(model) (pretrained statistics)"),
    "gn": ("GroupNorm", "normkit.get_norm_layer('gn', C) (32 groups or fewer)"),
    "ln": ("LayerNorm", "normkit.get_norm_layer('ln', d) (normkit.LayerNormLSTM for LSTMs)"),
    "ln2d": ("LayerNorm2d", "normkit.get_norm_layer('ln2d', C)"),
    "rms": ("RMSNorm", "normkit.get_norm_layer('rms', d)"),
    "in": ("InstanceNorm", "normkit.InstanceNorm2d(C, affine=True)"),
    "wn": ("weight normalization", "normkit.weight_norm(layer) (no activation statistics)"),
    "pn": ("PowerNorm", "normkit.get_norm_layer('pn', d) (tokens (*, d); padding_mask=)"),
}

_ALL = frozenset({"cnn", "mlp", "rnn", "transformer", "style"})
_BN_LIKE = frozenset({"bn", "syncbn", "batchrenorm", "frozenbn"})

_ARTICLE_BN_LN = "《深度学习归一化技术：BN与LN原理及应用对比》"
_ARTICLE_NORM = "《归一化那些事》"


@dataclass(frozen=True)
class _Query:
    architecture: str  # canonical group: cnn, mlp, rnn, transformer, style
    batch_size: int
    task: str | None
    sequence: bool | None
    distributed: bool
    world_size: int | None
    dtype: str | None = None  # "float16", "bfloat16", "float32", "float64" or unknown


@dataclass(frozen=True)
class When:
    """The conditions of one row of :data:`RULES` or :data:`NOTES` (all must hold).

    Args:
        architectures: canonical architectures (``cnn``, ``mlp``, ``rnn``,
            ``transformer``, ``style``) the row applies to. Default: all.
        min_batch: per-device batch size at least this. Default: ``1``.
        max_batch: per-device batch size below this (``None``: no bound).
        tasks: the row needs one of these tasks (``None``: any task, or none given).
        sequence: ``True``/``False``: the row needs ``sequence`` given and equal.
        distributed: ``True``/``False``: the row needs that setting.
        min_global_batch: per-device batch × ``world_size`` at least this (the row
            then needs ``world_size``).
        families: for notes: the chosen family is one of these.
        dtypes: the row needs ``dtype`` given and one of these (``None``: any).

    Example:
        >>> When(architectures=frozenset({"cnn"}), max_batch=32).max_batch
        32
    """

    architectures: frozenset[str] = _ALL
    min_batch: int = 1
    max_batch: int | None = None
    tasks: frozenset[str] | None = None
    sequence: bool | None = None
    distributed: bool | None = None
    min_global_batch: int | None = None
    families: frozenset[str] | None = None
    dtypes: frozenset[str] | None = None

    def matches(self, query: _Query, family: str | None = None) -> bool:
        """Whether every condition holds for ``query`` (and the chosen ``family``)."""
        batch = query.batch_size
        checks = (
            query.architecture in self.architectures,
            batch >= self.min_batch,
            self.max_batch is None or batch < self.max_batch,
            self.tasks is None or query.task in self.tasks,
            self.sequence is None or query.sequence is self.sequence,
            self.distributed is None or query.distributed is self.distributed,
            self.min_global_batch is None or (
                query.world_size is not None
                and batch * query.world_size >= self.min_global_batch),
            self.families is None or family in self.families,
            self.dtypes is None or query.dtype in self.dtypes,
        )
        return all(checks)


@dataclass(frozen=True)
class Choice:
    """What a row of :data:`RULES` recommends.

    Example:
        >>> Choice("gn", ("batchrenorm",), ("stable across batch sizes",)).family
        'gn'
    """

    family: str
    alternatives: tuple[str, ...]
    reasons: tuple[str, ...]


def _archs(*names: str) -> frozenset[str]:
    return frozenset(names)


_WU_HE = ("Wu & He 2018 (Group Normalization): ResNet-50 ImageNet error at 32/16/8/4/2 "
          "images per GPU is 23.6/23.7/24.8/27.3/34.7 % with BN and 24.1/24.2/24.0/24.2/24.1 % "
          "with GN: GN does not depend on the batch size, BN degrades below 16")

#: The selection guide: the first matching row decides. Each row cites its source.
RULES: tuple[tuple[When, Choice], ...] = (
    (When(tasks=frozenset({"style-transfer"})), Choice(
        "in", ("gn", "ln2d"),
        ("style transfer: Instance Normalization removes each image's own contrast and makes "
         "one image's output independent of the rest of the batch (Ulyanov, Vedaldi & "
         "Lempitsky 2016)",))),
    (When(architectures=_archs("style")), Choice(
        "in", ("bn", "gn"),
        ("image generators for style transfer normalize each image by its own statistics: "
         "InstanceNorm (Ulyanov, Vedaldi & Lempitsky 2016); "
         f"{_ARTICLE_BN_LN} §4.3 lists IN among the variants beyond BN/LN",))),
    (When(tasks=frozenset({"reinforcement-learning"})), Choice(
        "ln", ("wn",),
        (f"{_ARTICLE_BN_LN} §3.2: LN suits reinforcement learning (policy networks, online "
         "updates) because it does not depend on batch statistics",
         f"{_ARTICLE_NORM}: batch statistics act as noise, which noise-sensitive models such "
         "as reinforcement learning do not tolerate; weight normalization avoids data "
         "statistics altogether"))),
    (When(architectures=_archs("transformer")), Choice(
        "ln", ("rms", "pn"),
        (f"{_ARTICLE_BN_LN} §4.2: RNN/Transformer must use LN (LN has no train/inference "
         "difference and does not depend on the batch)",
         f"pre-norm, as in the encoder layer of {_ARTICLE_BN_LN} §3.2 (norm1 before "
         "self-attention, norm2 before the feed-forward block)",
         "RMSNorm is the cheaper alternative: 7-64 % less running time than LN at equal "
         "quality (Zhang & Sennrich 2019)",
         "where batch statistics are wanted, PowerNorm rather than BatchNorm: Shen et "
         "al. 2020 find BatchNorm's batch statistics too unstable in NLP Transformers "
         "and report PowerNorm matching or beating LN on translation and language "
         "modelling (their claim; on the lab's small Transformer over digit rows, "
         "normkit lab's `transformer`, neither LN nor PowerNorm beat BatchNorm)"))),
    (When(architectures=_archs("rnn")), Choice(
        "ln", ("wn",),
        (f"{_ARTICLE_BN_LN} §2.3 and §4.2: BN does not fit RNNs (statistics differ per time "
         "step, lengths vary); LN normalizes each sample and step",
         f"{_ARTICLE_NORM}: in an RNN/LSTM, add LN at every time step; normkit.LayerNormLSTM "
         "is nn.LSTM with LN inside the cell (Ba, Kiros & Hinton 2016: RNNs converge "
         "faster with LN)"))),
    (When(architectures=_archs("cnn"), max_batch=BN_MIN_BATCH,
          tasks=frozenset({"fine-tuning"})), Choice(
        "frozenbn", ("gn", "batchrenorm"),
        ("fine-tuning a pretrained BN backbone at a small batch: keep its population "
         "statistics fixed (FrozenBatchNorm, the detectron2 default) instead of "
         "re-estimating them from a few images per device",
         _WU_HE))),
    (When(architectures=_archs("cnn"), max_batch=BN_MIN_BATCH, distributed=True,
          min_global_batch=BN_MIN_BATCH), Choice(
        "syncbn", ("gn", "batchrenorm"),
        ("SyncBatchNorm pools the statistics of every device, so BN sees the global batch "
         f"(per-device batch x world size >= {BN_MIN_BATCH}) although each device has few "
         "images",
         _WU_HE))),
    (When(architectures=_archs("cnn"), min_batch=BN_MIN_BATCH), Choice(
        "bn", ("gn",),
        (f"{_ARTICLE_BN_LN} §4.2: CNNs prefer BN, and at batch >= 32 BN is usually better",
         "Wu & He 2018: at 32 images per GPU BN has 23.6 % ResNet-50 error vs GN 24.1 %"))),
    (When(architectures=_archs("cnn")), Choice(
        "gn", ("batchrenorm", "frozenbn"),
        (f"{_ARTICLE_BN_LN} §2.3: BN is sensitive to small batches (< 16: statistics are "
         "inaccurate and accuracy drops); the guide says batch >= 32 for BN",
         _WU_HE))),
    (When(architectures=_archs("mlp"), sequence=True), Choice(
        "ln", ("rms",),
        (f"{_ARTICLE_BN_LN} §3.2: per-token features of variable-length sequences: LN does "
         "not depend on the batch or the sequence length",))),
    (When(architectures=_archs("mlp"), min_batch=BN_MIN_BATCH), Choice(
        "bn", ("ln",),
        (f"{_ARTICLE_BN_LN} §4.2: large batch (>= 32): BN is usually better; "
         f"{_ARTICLE_NORM}: BN over (batch, features) for vector inputs (BatchNorm1d)",))),
    (When(architectures=_archs("mlp")), Choice(
        "ln", ("rms", "bn"),
        (f"{_ARTICLE_BN_LN} §4.2: small batch or online learning: choose LN",
         f"{_ARTICLE_NORM}: LN drops straight into an MLP and does not depend on the "
         "batch"))),
)

#: Cautions: every matching row adds its text.
NOTES: tuple[tuple[When, str], ...] = (
    (When(families=_BN_LIKE),
     f"validate and test in eval mode (model.eval()): BN then uses its running statistics "
     f"({_ARTICLE_BN_LN} §2.3, §5.2)"),
    (When(families=frozenset({"bn", "syncbn", "batchrenorm"})),
     "if validation accuracy suddenly drops, suspect the running statistics; recompute them "
     "with normkit.update_bn_stats(model, train_loader) before evaluating "
     f"({_ARTICLE_BN_LN} §5.2), and run normkit.tools.doctor.doctor to compare them with the "
     "data"),
    (When(families=_BN_LIKE, dtypes=frozenset({"float16"})),
     "in float16 (model.half()) keep the BatchNorm layers in float32 -- layer.float(): they "
     "take float16 input with float32 parameters and statistics -- or train with "
     "torch.autocast, which leaves them float32: a running variance past float16's 65504 "
     "(a channel's standard deviation above 256) is stored as inf and that channel outputs "
     "its bias alone in inference, where LayerNorm and GroupNorm store nothing "
     f"({_ARTICLE_BN_LN} §5.4; the lab's half-precision experiment: 90 % test error at "
     "input scale 1000, 1.1 % with the norms in float32); fold BatchNorm before .half() "
     "for inference (normkit.fold_batchnorm)"),
    (When(architectures=_archs("cnn"), max_batch=BN_MIN_BATCH, distributed=True),
     "distributed with a small per-device batch: normkit.convert_sync_batchnorm pools BN "
     f"statistics over all devices; with per-device batch x world size >= {BN_MIN_BATCH} it "
     "restores BN's accuracy (pass world_size= to let recommend() decide)"),
    (When(architectures=_archs("cnn", "mlp"), sequence=True),
     "padded variable-length sequences leak padding into BN's batch statistics: mask them "
     "or use a per-sample norm (LN/GN)"),
    (When(tasks=frozenset({"speech"})),
     f"speech recognition: {_ARTICLE_BN_LN} §4.2 suggests trying BN or LN, or both (BN in "
     "the convolutional front end, LN in the recurrent/attention part)"),
    (When(architectures=_archs("cnn"), families=frozenset({"gn"})),
     "with GroupNorm, standardize each convolution's weights "
     "(normkit.weight_standardization(conv)): Qiao et al. 2019 report GN with weight "
     "standardization at 1 image per GPU matching or beating BN trained with large "
     "batches (their claim; the lab does not test it)"),
    (When(tasks=frozenset({"detection", "segmentation"})),
     "detection and segmentation usually train with 1-2 images per device: Wu & He 2018 "
     "use GN there; FrozenBatchNorm keeps a pretrained backbone's statistics"),
    (When(architectures=_archs("style")),
     "GAN discriminators: a batch-dependent norm lets the discriminator see the batch's "
     "composition; prefer no norm, LN or IN there"),
    (When(architectures=_archs("transformer")),
     f"early training can be unstable with LN: use learning-rate warmup ({_ARTICLE_BN_LN} "
     "§5.2)"),
    (When(),
     f"initialize gamma = 1 and beta = 0 so the norm starts as a pure standardization "
     f"({_ARTICLE_BN_LN} §5.1; normkit's and torch's defaults)"),
)


@dataclass(frozen=True)
class Recommendation:
    """A normalization recommendation: the family, alternatives, reasons and cautions.

    ``family`` and ``alternatives`` are keys of :data:`FAMILIES` (``bn``, ``gn``,
    ``ln``, ``rms``, ``in``, ``syncbn``, ``batchrenorm``, ``frozenbn``, ``ln2d``,
    ``wn``, ``pn``); :attr:`usage` says how to get the family in normkit.

    Example:
        >>> rec = recommend("cnn", 8)
        >>> rec.family, rec.alternatives
        ('gn', ('batchrenorm', 'frozenbn'))
        >>> print(str(rec).splitlines()[0])
        GroupNorm ('gn') for cnn at batch 8 per device
    """

    family: str
    alternatives: tuple[str, ...]
    reasons: tuple[str, ...]
    cautions: tuple[str, ...]
    architecture: str = ""
    batch_size: int | None = None

    @property
    def usage(self) -> str:
        """How to get :attr:`family` in normkit.

        Example:
            >>> recommend("transformer", 4).usage
            "normkit.get_norm_layer('ln', d) (normkit.LayerNormLSTM for LSTMs)"
        """
        return FAMILIES.get(self.family, (self.family, self.family))[1]

    def to_dict(self) -> dict:
        """Plain, JSON-serializable fields.

        Example:
            >>> sorted(recommend("mlp", 64).to_dict())
            ['alternatives', 'architecture', 'batch_size', 'cautions', 'family', 'reasons']
        """
        return {"family": self.family, "alternatives": list(self.alternatives),
                "reasons": list(self.reasons), "cautions": list(self.cautions),
                "architecture": self.architecture, "batch_size": self.batch_size}

    def __str__(self) -> str:
        title = FAMILIES.get(self.family, (self.family,))[0]
        where = f" for {self.architecture}" if self.architecture else ""
        if self.batch_size is not None:
            where += f" at batch {self.batch_size} per device"
        lines = [f"{title} ({self.family!r}){where}", f"  use: {self.usage}"]

        def bullets(label: str, items) -> None:
            if items:
                lines.append(f"  {label}:")
                for item in items:
                    lines.append(textwrap.fill(item, 100, initial_indent="    - ",
                                               subsequent_indent="      ", break_on_hyphens=False))

        bullets("why", self.reasons)
        alts = [f"{a}: {FAMILIES.get(a, (a, a))[1]}" for a in self.alternatives]
        bullets("alternatives", alts)
        bullets("cautions", self.cautions)
        return "\n".join(lines)


def _canonical_architecture(architecture) -> str:
    if not isinstance(architecture, str) or architecture.strip().lower() not in ARCHITECTURES:
        raise ValueError(
            f"architecture must be one of {', '.join(ARCHITECTURES)} (case-insensitive), "
            f"got {architecture!r}")
    return architecture.strip().lower()


def _canonical_task(task) -> str | None:
    if task is None:
        return None
    if isinstance(task, str):
        key = "-".join(task.strip().lower().replace("_", " ").split())
        key = _TASK_ALIASES.get(key, key)
        if key in TASKS:
            return key
    raise ValueError(f"task must be None or one of {', '.join(TASKS)} (case-insensitive), "
                     f"got {task!r}")


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{what} must be a positive int, got {value!r}")
    return int(value)


#: ``dtype`` names :func:`recommend` accepts, and what they mean
_DTYPES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16",
           "float32": "float32", "float": "float32", "float64": "float64", "double": "float64"}


def _canonical_dtype(dtype: torch.dtype | str | None) -> str | None:
    """``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"`` or ``None``.

    Example:
        >>> _canonical_dtype(torch.half), _canonical_dtype("BFloat16"), _canonical_dtype(None)
        ('float16', 'bfloat16', None)
    """
    if dtype is None:
        return None
    if isinstance(dtype, torch.dtype):
        name = str(dtype).removeprefix("torch.")
    elif isinstance(dtype, str):
        name = dtype.lower().removeprefix("torch.")
    else:
        name = None
    if name not in _DTYPES:
        raise ValueError(f"dtype must be a floating torch.dtype or one of "
                         f"{', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def recommend(
    architecture: str,
    batch_size: int,
    task: str | None = None,
    *,
    sequence: bool | None = None,
    distributed: bool = False,
    world_size: int | None = None,
    dtype: torch.dtype | str | None = None,
) -> Recommendation:
    """Recommend a normalization family: the articles' selection guide as a rule table.

    The first row of :data:`RULES` that matches picks the family (each row cites its
    source); every matching row of :data:`NOTES` adds a caution. In short:

    =================================  ======================  ===========================
    architecture, per-device batch     family                  alternatives
    =================================  ======================  ===========================
    cnn, batch >= 32                   ``bn``                  ``gn``
    cnn, batch < 32                    ``gn``                  ``batchrenorm``, ``frozenbn``
    cnn, batch < 32, fine-tuning       ``frozenbn``            ``gn``, ``batchrenorm``
    cnn, batch < 32, batch x world     ``syncbn``              ``gn``, ``batchrenorm``
    >= 32 (distributed)
    rnn / lstm / gru                   ``ln`` (LayerNormLSTM)  ``wn``
    transformer                        ``ln`` (pre-norm)       ``rms``, ``pn``
    mlp, batch >= 32                   ``bn``                  ``ln``
    mlp, batch < 32                    ``ln``                  ``rms``, ``bn``
    gan / style                        ``in``                  ``bn``, ``gn``
    =================================  ======================  ===========================

    Sources: 《深度学习归一化技术：BN与LN原理及应用对比》 §4.2 (CNN → BN at batch ≥ 32; small
    batches, RNNs and Transformers → LN), 《归一化那些事》 (BN needs enough samples per
    batch; LN per RNN time step), Wu & He 2018 (GN is flat across batch sizes, BN's error
    grows below 16 images per GPU), Zhang & Sennrich 2019 (RMSNorm), Ulyanov et al. 2016
    (InstanceNorm for style transfer).

    Args:
        architecture: one of :data:`ARCHITECTURES` (case-insensitive).
        batch_size: the per-device batch size, a positive int.
        task: ``None`` or one of :data:`TASKS` (``"fine-tuning"``, ``"style-transfer"``,
            ``"reinforcement-learning"`` change the choice; the others add cautions).
        sequence: ``True`` when the inputs are variable-length sequences (an MLP over
            tokens then gets LN). Default: ``None`` (unknown).
        distributed: data-parallel training over several devices. Default: ``False``.
        world_size: the number of devices; with ``distributed`` it lets a small
            per-device CNN batch get SyncBatchNorm when the global batch is >= 32.
        dtype: the dtype the model's layers are stored in (``torch.float16`` or
            ``"float16"``/``"half"``, ``"bfloat16"``, ``"float32"``, ``"float64"``);
            float16 adds a caution to the BatchNorm families (their running statistics
            overflow past 65504). Default: ``None`` (unknown). Under ``torch.autocast``
            the layers stay float32: pass ``"float32"``.

    Returns:
        A :class:`Recommendation`.

    Example:
        >>> recommend("CNN", 64).family
        'bn'
        >>> recommend("cnn", 8, distributed=True, world_size=8).family
        'syncbn'
        >>> recommend("Transformer", 16).alternatives
        ('rms', 'pn')
        >>> recommend("vit", 8)
        Traceback (most recent call last):
        ...
        ValueError: architecture must be one of cnn, mlp, rnn, ... got 'vit'
    """
    name = _canonical_architecture(architecture)
    batch = _positive_int(batch_size, "batch_size (per device)")
    if sequence is not None and not isinstance(sequence, bool):
        raise ValueError(f"sequence must be None, True or False, got {sequence!r}")
    if not isinstance(distributed, bool):
        raise ValueError(f"distributed must be True or False, got {distributed!r}")
    if world_size is not None:
        world_size = _positive_int(world_size, "world_size")
    query = _Query(_ARCH_GROUP.get(name, name), batch, _canonical_task(task), sequence,
                   distributed, world_size, _canonical_dtype(dtype))
    choice = next(choice for when, choice in RULES if when.matches(query))
    cautions = tuple(text for when, text in NOTES if when.matches(query, choice.family))
    return Recommendation(choice.family, choice.alternatives, choice.reasons, cautions,
                          architecture=name, batch_size=batch)
