"""Secure aggregation of the round: fixed-point sums hidden behind pairwise masks, noised before
they are summed.

Every rank encodes its clients' (clipped) contributions as int64 fixed point, ``round(x·2^f)``, into
one running buffer (memory does not grow with clients). Rank 0 -- the trusted aggregator's noise
step -- also adds an *offset* (:meth:`SecureSummer.add_offset`: the Gaussian noise, encoded in the
same fixed point) to its own contribution. At the end of the round each rank adds pairwise masks
that cancel in the sum modulo 2^64 -- rank i adds PRG(k_ij, round) for j > i and subtracts it for
j < i -- and the ranks run ONE all-reduce of the int64 buffer. The integer sum is exact, hence
independent of how clients are split over ranks and of their order: 1, 2 or 8 ranks give
bit-identical decoded sums, noise included.

Threat model (honest-but-curious ranks, anyone reading the wire):
* what a rank receives from the all-reduce is the NOISED total: the clean sum of the clients'
  contributions is never formed on any rank;
* what a peer or the wire sees of a rank's buffer is masked: uniform on Z_2^64 whatever the inputs
  (``research`` and ``secure`` modes; ``plain`` has no masks and is refused in secure mode by the
  config);
* rank 0 drew the noise, so rank 0 can subtract it (and its own partial): it is the trusted
  aggregator of central DP, as in the design. Removing that trust needs distributed noise shares
  (TFF's distributed discrete Gaussian: every rank adds a share of discrete noise to its masked
  contribution), which this module does not implement;
* with two ranks, rank 1 learns rank 0's partial plus the noise, not the partial alone.
A rank that drops out fails the round (no dropout recovery).

Ranges: a field's ``bound`` limits one contribution per coordinate, its ``offset_bound`` the
offset rank 0 may add (the noise's tail, ``privacy.noise.TAIL_STDS`` standard deviations); the
construction checks that ``max_clients`` contributions plus the offset cannot overflow int64.

Modes: ``plain`` (no masks; exact fixed point only), ``research`` (pair keys derived from the run
seed with keyed BLAKE2b, masks from NumPy's Philox counter-mode generator: reproducible, NOT secret
from anyone who knows the seed), ``secure`` (X25519 key agreement over the communicator, HKDF-SHA256
pair keys, ChaCha20 keystream masks with (round, stream) in the nonce; fresh keys every process).

Wrap-around arithmetic is done in NumPy ``uint64``, which wraps by definition; the all-reduce adds
int64 two's complement values (wrapping in gloo and NCCL), and the tests check the cancellation.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import struct
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np
import torch

from cluster_fl.distributed import Comm
from cluster_fl.errors import UserError
from cluster_fl.transfer import to_device, to_device_together

MODES = ("plain", "research", "secure")
_TWO63 = 2.0 ** 63
_SLACK = 1.0 + 2.0 ** -20  # float32 clipping may overshoot a bound by a few ulps
_CHUNK = 1 << 20  # mask generation chunk (elements): keeps peak memory flat


class SecureSumRangeError(UserError, ValueError):
    """The fixed-point configuration could overflow int64, or a contribution broke its bound."""


def mask_mode(secure_sum: bool, secure_mode: bool) -> str:
    """Mode from the config: ``aggregation.secure_sum`` and ``privacy.secure_mode``."""
    if not secure_sum:
        return "plain"
    return "secure" if secure_mode else "research"


def encode(x: torch.Tensor | float, frac_bits: int) -> torch.Tensor:
    """Fixed point: ``round(x·2^frac_bits)`` as int64 (round half to even). Exact up to the
    rounding itself for float16/32/64 inputs; raises on NaN/Inf or values beyond int64."""
    scaled = _scale(x, frac_bits)
    if scaled.numel():
        peak = float(torch.linalg.vector_norm(scaled, float("inf")))  # NaN/Inf propagate
        if not math.isfinite(peak):
            raise ValueError("cannot encode non-finite values (zero a NaN/Inf client first)")
        if peak >= _TWO63:
            raise SecureSumRangeError(f"value {peak * 2.0 ** -frac_bits!r} does not fit int64 "
                                      f"with {frac_bits} fractional bits")
    return scaled.to(torch.int64)


def _scale(x: torch.Tensor | float, frac_bits: int) -> torch.Tensor:
    # Scaling by a power of two and rounding are exact in the input's own float format, so a
    # float32 update needs no float64 copy and gives the same integers as the float64 route.
    xt = torch.as_tensor(x).detach()
    if not xt.is_floating_point():
        xt = xt.to(torch.float64)
    elif xt.dtype in (torch.float16, torch.bfloat16):
        xt = xt.to(torch.float32)
    return torch.round(xt * 2.0 ** frac_bits)


def _peaks(xs: Sequence[torch.Tensor]) -> list[float]:
    """max |x| of each tensor (0 for an empty one; NaN/Inf propagate), in float64, read back in
    one transfer per device."""
    out = [0.0] * len(xs)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        if x.numel():
            by_device.setdefault(x.device, []).append(i)
    for idx in by_device.values():
        peaks = torch.stack([torch.linalg.vector_norm(xs[i], float("inf")).to(torch.float64)
                             for i in idx]).tolist()
        for i, peak in zip(idx, peaks):
            out[i] = peak
    return out


def decode(s: torch.Tensor, frac_bits: int) -> torch.Tensor:
    """int64 fixed point -> float64 ``s·2^-frac_bits`` (a deterministic function of ``s``)."""
    return s.to(torch.float64) * 2.0 ** -frac_bits


def check_range(max_abs_per_client: float, max_clients: int, frac_bits: int,
                offset: float = 0.0) -> float:
    """Raise :class:`SecureSumRangeError` when ``max_clients`` contributions of absolute value up
    to ``max_abs_per_client``, plus one offset of absolute value up to ``offset`` (rank 0's
    noise), could overflow int64 with ``frac_bits`` fractional bits. Returns the remaining
    headroom in bits (log2 of 2^63 over the worst-case sum)."""
    if not (max_abs_per_client >= 0 and math.isfinite(max_abs_per_client)):
        raise SecureSumRangeError(f"max_abs_per_client must be finite and >= 0, "
                                  f"got {max_abs_per_client!r}")
    if not (offset >= 0 and math.isfinite(offset)):
        raise SecureSumRangeError(f"offset must be finite and >= 0, got {offset!r}")
    if max_clients < 1 or not 0 <= frac_bits <= 62:
        raise SecureSumRangeError(f"need max_clients >= 1 and frac_bits in [0, 62], got "
                                  f"{max_clients} and {frac_bits}")
    # each client adds at most bound·2^f, plus 0.5 from rounding; the offset likewise, once
    extra = offset * 2.0 ** frac_bits + 0.5 if offset > 0 else 0.0
    worst = max_clients * (max_abs_per_client * _SLACK * 2.0 ** frac_bits + 0.5) + extra
    if worst >= _TWO63:
        per = ((_TWO63 - extra) / max_clients - 0.5) / max(max_abs_per_client * _SLACK
                                                           + offset / max_clients, 1e-300)
        ok_bits = math.floor(math.log2(per)) if per >= 1 else None
        hint = (f"use aggregation.fixed_point_bits <= {ok_bits}" if ok_bits is not None
                else "reduce the bound or the number of clients")
        raise SecureSumRangeError(
            f"fixed-point sum could overflow int64: {max_clients} clients x |x| <= "
            f"{max_abs_per_client:g}" + (f" + noise |z| <= {offset:g}" if offset else "")
            + f" at 2^{frac_bits} = {worst:.3g} >= 2^63; {hint}")
    return math.log2(_TWO63 / worst) if worst > 0 else math.inf


@dataclass(frozen=True)
class Field:
    """One named slice of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    frac_bits: int
    bound: float
    offset_bound: float = 0.0


class SecureSummer:
    """Streaming exact sum of named float tensors across clients and ranks.

    ``shapes`` names every field (update groups, adaptive statistics, counters); ``bounds`` gives
    the largest absolute value one contribution may have per coordinate (one number or per field:
    for clipped updates the clip norm C), checked on :meth:`add` and against ``max_clients`` with
    :func:`check_range` at construction. ``offset_bounds`` (per field, default 0: none) limit the
    offset one rank may add per reduction (:meth:`add_offset`: rank 0's noise).
    ``integer_fields`` are encoded with 0 fractional bits (counters). One buffer, one all-reduce
    per :meth:`reduce`.
    """

    def __init__(self, shapes: Mapping[str, int | Sequence[int]], *, frac_bits: int,
                 max_clients: int, bounds: float | Mapping[str, float], mode: str = "research",
                 seed: int = 0, integer_fields: Iterable[str] = (),
                 offset_bounds: Mapping[str, float] | None = None,
                 device: torch.device | str = "cpu", release_counts: bool = True,
                 job_secret: bytes | None = None):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        ints = set(integer_fields)
        unknown = ints - set(shapes)
        if unknown:
            raise ValueError(f"integer_fields not in shapes: {sorted(unknown)}")
        self.mode, self.seed, self.frac_bits, self.max_clients = mode, seed, frac_bits, max_clients
        # the per-field contribution counts (the overflow guard) summed with the values: exact,
        # un-noised counts of the clients that contributed, which every rank would learn. A DP
        # run does not send them: each client contributes at most once per field, so check_range
        # with max_clients (every client of the run) already rules out an overflow, and this
        # rank's own counts are checked before they are zeroed
        self.release_counts = release_counts
        self.job_secret = job_secret  # authenticates the pair keys' exchange (agree_pair_keys)
        self.fields: dict[str, Field] = {}
        offset = 0
        for name, shape in shapes.items():
            shape_t = (int(shape),) if isinstance(shape, int) else tuple(int(s) for s in shape)
            numel = math.prod(shape_t)
            bound = float(bounds if not isinstance(bounds, Mapping) else bounds[name])
            bits = 0 if name in ints else frac_bits
            noise = float((offset_bounds or {}).get(name, 0.0))
            check_range(bound, max_clients, bits, offset=noise)
            self.fields[name] = Field(name, shape_t, offset, numel, bits, bound, noise)
            offset += numel
        self.numel = offset
        # on the model's device: contributions are encoded where the updates live. After the
        # values, the contributions counted per field (the overflow guard after the sum; summed
        # with them) and, never summed, the range failures deferred add_many calls recorded
        # (per field the largest offending |x|, float64 bits; inf: non-finite)
        self._reduced = offset + len(self.fields)
        self._acc = torch.zeros(self._reduced + len(self.fields), dtype=torch.int64,
                                device=device)
        # rank 0's offset (the noise), on the host where masks are added; never in partial()
        self._offset: torch.Tensor | None = None
        self._index = {name: i for i, name in enumerate(self.fields)}
        self._pair_keys: dict[int, bytes] | None = None
        self._used: set[tuple[int, int]] = set()
        self.last_partial: dict[str, object] | None = None

    # ------------------------------------------------------------------ local accumulation
    def add(self, values: Mapping[str, torch.Tensor | float | int]) -> None:
        """Encode one contribution (a client's clipped update, its statistics; any subset of the
        fields) and add it to this rank's running sum."""
        self.add_many([values])

    def add_many(self, contributions: Sequence[Mapping[str, torch.Tensor | float | int]], *,
                 defer_check: bool = False) -> None:
        """Add several contributions (a block's clients) at once, with the same integers as one
        :meth:`add` each (int64 sums are exact, so order and grouping do not matter): every
        field of every contribution is range-checked first and nothing is added if any fails;
        then each field's values are encoded as one stacked tensor and summed. Values made on
        the host (statistics, diagnostics) reach the buffer's device in one asynchronous copy.

        The check reads every peak back in one transfer and raises here; ``defer_check`` makes
        it on the device instead (no host synchronisation): a failing call still adds nothing,
        and the failure -- the same error -- is raised by the next :meth:`reduce` (or
        :meth:`partial`, :meth:`check`), before anything is masked or sent."""
        fields, xs = [], []
        for values in contributions:
            for name, value in values.items():
                f = self.fields.get(name)
                if f is None:
                    raise KeyError(f"unknown secure-sum field {name!r}; known: "
                                   f"{list(self.fields)}")
                x = torch.as_tensor(value).detach()
                if not x.is_floating_point():  # counters: ints are exact in float64 up to 2^53
                    x = x.to(torch.float64)
                if x.numel() != f.numel:
                    raise ValueError(f"field {name!r}: expected {f.numel} values, got "
                                     f"{x.numel()}")
                fields.append(f)
                xs.append(x.reshape(-1))
        if not xs:
            return
        xs = to_device_together(xs, self._acc.device)  # host-made values: one copy
        if defer_check:
            ok = self._check_on_device(fields, xs)
        else:
            self._check_now(fields, xs)
            ok = None
        by_field: dict[str, list[torch.Tensor]] = {}
        for f, x in zip(fields, xs):
            by_field.setdefault(f.name, []).append(x)
        for name, parts in by_field.items():
            f = self.fields[name]
            # within its bound, check_range guarantees each encoding and the sum fit int64
            encoded = [_scale(t, f.frac_bits).to(torch.int64) for t in parts]
            enc = encoded[0] if len(encoded) == 1 else torch.stack(encoded).sum(0)
            if ok is None:
                self._acc[f.offset:f.offset + f.numel] += enc
                self._acc[self.numel + self._index[name]] += len(parts)
            else:  # a deferred failure adds nothing (0 x the encoding, 0 contributions)
                self._acc[f.offset:f.offset + f.numel] += enc * ok
                self._acc[self.numel + self._index[name]] += ok * len(parts)

    def _check_now(self, fields: Sequence[Field], xs: Sequence[torch.Tensor]) -> None:
        for f, x, peak in zip(fields, xs, _peaks(xs)):
            if not math.isfinite(peak):
                raise ValueError(f"field {f.name!r}: non-finite values (zero a NaN/Inf "
                                 "client before adding it)")
            if peak > f.bound * _SLACK:
                raise SecureSumRangeError(f"field {f.name!r}: |x| = {peak:g} exceeds its bound "
                                          f"{f.bound:g} (clip before adding)")

    def _check_on_device(self, fields: Sequence[Field], xs: Sequence[torch.Tensor]
                         ) -> torch.Tensor:
        """The range check of :meth:`add_many` without a read: records each failing field's
        largest |x| (inf when non-finite) in the buffer's tail; returns 1 if every value is
        within its bound, else 0 (int64, on the device)."""
        dev = self._acc.device
        peaks = torch.stack([torch.linalg.vector_norm(x, float("inf")).to(torch.float64)
                             if x.numel() else torch.zeros((), dtype=torch.float64, device=dev)
                             for x in xs])
        host = torch.tensor([f.bound * _SLACK for f in fields]
                            + [float(self._index[f.name]) for f in fields], dtype=torch.float64)
        limits = to_device(host, dev)
        bound, where = limits[:len(fields)], limits[len(fields):].to(torch.int64)
        bad = ~(peaks <= bound)  # NaN fails too
        worst = torch.where(bad, peaks.nan_to_num(nan=math.inf), 0.0)
        faults = self._acc[self._reduced:].view(torch.float64)
        faults.scatter_reduce_(0, where, worst, "amax")
        return (~bad.any()).to(torch.int64)

    def check(self) -> None:
        """Raise the range failure a deferred :meth:`add_many` recorded, if any (one read)."""
        self._raise_faults(self._acc[self._reduced:].cpu())

    def _raise_faults(self, tail: torch.Tensor) -> None:
        """``tail``: the buffer's fault slots, on the host."""
        for f, peak in zip(self.fields.values(), tail.view(torch.float64).numpy().tolist()):
            if peak == math.inf:
                raise ValueError(f"field {f.name!r}: non-finite values (zero a NaN/Inf "
                                 "client before adding it)")
            if peak > 0:
                raise SecureSumRangeError(f"field {f.name!r}: |x| = {peak:g} exceeds its bound "
                                          f"{f.bound:g} (clip before adding)")

    def add_offset(self, values: Mapping[str, torch.Tensor]) -> None:
        """Encode an offset (rank 0's noise; any subset of the fields) into this rank's
        contribution to the next :meth:`reduce`: the all-reduce then returns the offset total to
        every rank and no rank receives the sum without it. Each coordinate must lie within its
        field's ``offset_bound``; an offset is not a client (it does not count towards
        ``max_clients``) and may be added once per reduction."""
        if self._offset is not None:
            raise ValueError("an offset was already added for this reduction")
        buf = torch.zeros(self._reduced, dtype=torch.int64)
        for name, value in values.items():
            f = self.fields.get(name)
            if f is None:
                raise KeyError(f"unknown secure-sum field {name!r}; known: {list(self.fields)}")
            x = torch.as_tensor(value).detach().to("cpu", torch.float64).reshape(-1)
            if x.numel() != f.numel:
                raise ValueError(f"field {name!r}: expected {f.numel} values, got {x.numel()}")
            if x.numel():
                peak = float(torch.linalg.vector_norm(x, float("inf")))
                if not peak <= f.offset_bound:  # NaN fails too
                    raise SecureSumRangeError(f"field {name!r}: offset |x| = {peak:g} exceeds "
                                              f"its offset bound {f.offset_bound:g}")
            buf[f.offset:f.offset + f.numel] = _scale(x, f.frac_bits).to(torch.int64)
        self._offset = buf

    def reset(self) -> None:
        """Forget this rank's running sum and offset (reduce does this itself)."""
        self._acc.zero_()
        self._offset = None

    def partial(self) -> dict[str, torch.Tensor]:
        """This rank's unmasked running sum, decoded (what only this rank may know); raises a
        deferred range failure (:meth:`add_many`)."""
        buf = self._acc.cpu()
        self._raise_faults(buf[self._reduced:])
        return self._decode(buf)

    def _decode(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f.name: decode(buf[f.offset:f.offset + f.numel], f.frac_bits).reshape(f.shape)
                for f in self.fields.values()}

    # ------------------------------------------------------------------ the masked all-reduce
    def reduce(self, comm: Comm, round: int, *, stream: int = 0,
               record: bool = False) -> dict[str, torch.Tensor]:
        """Mask, all-reduce once, decode: the exact float64 sum over every rank's contributions and
        offsets, identical on every rank. ``(round, stream)`` must not repeat (a repeat would reuse
        masks); use ``stream`` for a second reduction in one round. ``record`` keeps what a peer
        sees in :attr:`last_partial` = ``{"masked": int64 Tensor, "plain": {field: float64
        Tensor}}``. Resets the running sum. Collective: every rank must call it."""
        if not 0 <= round < 2 ** 63 or not 0 <= stream < 2 ** 32:
            raise ValueError(f"round must be in [0, 2^63) and stream in [0, 2^32), got "
                             f"{round}, {stream}")
        if (round, stream) in self._used and self.mode != "plain":
            raise ValueError(f"masks for round {round} stream {stream} were already used")
        self._used.add((round, stream))
        if self.mode == "secure" and comm.world_size > 1 and self._pair_keys is None:
            self._pair_keys = agree_pair_keys(comm, self.job_secret)
        masked = self.masked_partial(comm.rank, comm.world_size, round, stream, record=record)
        comm.all_reduce_sum(masked, slow=True)  # waits for the slowest lane to finish training
        self.reset()
        counts = masked[self.numel:]
        if counts.numel() and (bool((counts < 0).any()) or int(counts.max()) > self.max_clients):
            raise SecureSumRangeError(
                f"more than max_clients={self.max_clients} contributions to one field "
                f"({counts.tolist()}): the int64 sum may have overflowed")
        return self._decode(masked)

    def masked_partial(self, rank: int, world_size: int, round: int, stream: int = 0, *,
                       record: bool = False) -> torch.Tensor:
        """This rank's running sum as its peers and the wire see it: the int64 fixed-point buffer
        (with its per-field counts) plus its offset and the pairwise masks of (round, stream), on
        the host.
        ``record`` keeps it, with the unmasked partial, in :attr:`last_partial`. Secure mode
        needs the pair keys that :meth:`reduce` agrees over the communicator."""
        # masks are generated on the host (numpy Philox / ChaCha20); only the int64 sum crosses
        # to the communicator's device (TorchComm stages it for NCCL). One copy from the device
        # brings the deferred range failures along: checked before anything is masked or sent
        full = self._acc.to("cpu", copy=True)
        self._raise_faults(full[self._reduced:])
        masked = full[:self._reduced]
        if not self.release_counts:
            counts = masked[self.numel:]
            if counts.numel() and int(counts.max()) > self.max_clients:
                raise SecureSumRangeError(
                    f"more than max_clients={self.max_clients} contributions to one field on "
                    "this rank: the int64 sum may overflow")
            counts.zero_()
        if self._offset is not None:  # int64 adds wrap like the masks; the range check bounds it
            masked += self._offset
        if self.mode != "plain" and world_size > 1:
            if self.mode == "secure" and self._pair_keys is None:
                raise ValueError("secure mode: the pair keys are agreed by reduce() first")
            self._apply_masks(masked, rank, world_size, round, stream)
        if record:
            self.last_partial = {"masked": masked.clone(), "plain": self.partial()}
        return masked

    def pair_keys(self, comm: Comm) -> dict[int, bytes]:
        """Secure mode: the pair keys with every peer, agreed (authenticated) on first use.
        Collective the first time."""
        if self._pair_keys is None:
            self._pair_keys = agree_pair_keys(comm, self.job_secret)
        return self._pair_keys

    def key_fingerprints(self) -> dict[int, str]:
        """Secure mode: a short hash of each pair key by peer rank (tests: keys differ per run)."""
        return {j: hashlib.blake2b(k, digest_size=8).hexdigest()
                for j, k in (self._pair_keys or {}).items()}

    def _secure_key(self, peer: int) -> bytes:
        """The pair key agreed with ``peer`` (secure mode; agreed at the first reduce)."""
        if self._pair_keys is None:
            raise RuntimeError("secure-mode pair keys are agreed at the first reduce")
        return self._pair_keys[peer]

    def _apply_masks(self, buf: torch.Tensor, rank: int, world: int, round: int,
                     stream: int) -> None:
        view = buf.numpy().view(np.uint64)  # shares memory; uint64 wraps mod 2^64
        for peer in range(world):
            if peer == rank:
                continue
            lo, hi = min(rank, peer), max(rank, peer)
            chunks = (_philox_chunks(self.seed, lo, hi, round, stream, view.size)
                      if self.mode == "research" else
                      _chacha_chunks(self._secure_key(peer), round, stream, view.size))
            for start, mask in chunks:
                part = view[start:start + mask.size]
                if rank < peer:
                    np.add(part, mask, out=part)
                else:
                    np.subtract(part, mask, out=part)


def _philox_chunks(seed: int, lo: int, hi: int, round: int, stream: int, n: int):
    """Research-mode masks: Philox keyed by BLAKE2b(seed, pair, round, stream)."""
    key = hashlib.blake2b(struct.pack("<QQQQI", seed, lo, hi, round, stream), digest_size=16,
                          person=b"cfl.securesum.v1").digest()
    gen = np.random.Philox(key=int.from_bytes(key, "little"))
    for start in range(0, n, _CHUNK):
        yield start, gen.random_raw(min(_CHUNK, n - start))


def _chacha_chunks(key: bytes, round: int, stream: int, n: int):
    """Secure-mode masks: the ChaCha20 keystream under the pair key, nonce = (round, stream)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    # cryptography's 16-byte ChaCha20 nonce = 4-byte block counter (from 0) + 12-byte nonce
    nonce = struct.pack("<IQI", 0, round, stream)
    enc = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor()
    zeros = bytes(8 * min(_CHUNK, n))
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        yield start, np.frombuffer(enc.update(zeros[:8 * m]), dtype="<u8").astype(np.uint64,
                                                                                    copy=False)


class KeyAuthenticationError(UserError):
    """A peer's public key does not carry the job secret's tag: not one of this job's processes
    (or the wire was tampered with)."""


def _key_tag(job_secret: bytes, rank: int, public: bytes) -> bytes:
    return hmac.new(job_secret, b"cluster_fl x25519 v1" + struct.pack("<Q", rank) + public,
                    hashlib.sha256).digest()


def agree_pair_keys(comm: Comm, job_secret: bytes | None = None) -> dict[int, bytes]:
    """X25519 with every peer (keypairs from the OS CSPRNG, public keys all-gathered), then
    HKDF-SHA256 bound to the ordered pair and both public keys. Returns {peer rank: 32-byte key}.

    ``job_secret`` (a secret only the job's processes can read: the engine's is a 0600 file
    beside the operator log) authenticates the public keys: each travels with an HMAC-SHA256 tag
    under it, checked before use, so a party on the wire cannot put its own key in the middle.
    Without one (library use, tests) the keys are exchanged unauthenticated."""
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    private = X25519PrivateKey.generate()
    raw = serialization.Encoding.Raw, serialization.PublicFormat.Raw
    mine = private.public_key().public_bytes(*raw)
    tag = _key_tag(job_secret, comm.rank, mine) if job_secret is not None else b""
    gathered = comm.all_gather_object((mine, tag))
    publics = [bytes(pub) for pub, _ in gathered]
    keys: dict[int, bytes] = {}
    for peer, pub in enumerate(publics):
        if peer == comm.rank:
            continue
        if job_secret is not None and not hmac.compare_digest(
                bytes(gathered[peer][1]), _key_tag(job_secret, peer, pub)):
            raise KeyAuthenticationError(
                f"rank {peer}'s public key fails its job-secret tag: not a process of this job "
                "(or the interconnect was tampered with); the secure sum stops here")
        shared = private.exchange(X25519PublicKey.from_public_bytes(pub))
        lo, hi = min(comm.rank, peer), max(comm.rank, peer)
        info = b"cluster_fl secure sum v1" + struct.pack("<QQ", lo, hi) + publics[lo] + publics[hi]
        keys[peer] = HKDF(algorithm=hashes.SHA256(), length=32, salt=job_secret,
                          info=info).derive(shared)
    return keys


def share_from_rank0(comm: Comm, pair_keys: Mapping[int, bytes], value: bytes | None,
                     purpose: str) -> bytes:
    """Rank 0's ``value`` (a key, a seed) handed to every rank, each rank's copy encrypted and
    authenticated under a key derived from its pair key with rank 0 (ChaCha20-Poly1305, a fresh
    nonce, the purpose and the rank as associated data): nothing of it crosses the wire in plain,
    and a rank reads only its own copy. Collective."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    def box_key(pair_key: bytes) -> bytes:  # not the masks' key itself: one key, one use
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None,
                    info=b"cluster_fl box v1|" + purpose.encode()).derive(pair_key)

    def aad(rank: int) -> bytes:
        return purpose.encode() + struct.pack("<Q", rank)

    if comm.world_size == 1:
        if value is None:
            raise ValueError("rank 0 shares a value")
        return value
    boxes: dict[int, bytes] | None = None
    if comm.rank == 0:
        if value is None:
            raise ValueError("rank 0 shares a value")
        boxes = {}
        for peer in range(1, comm.world_size):
            nonce = os.urandom(12)
            boxes[peer] = nonce + ChaCha20Poly1305(box_key(pair_keys[peer])).encrypt(
                nonce, value, aad(peer))
    boxes = comm.broadcast_object(boxes)
    if comm.rank == 0:
        assert value is not None
        return value
    assert boxes is not None
    box = boxes[comm.rank]
    return ChaCha20Poly1305(box_key(pair_keys[0])).decrypt(box[:12], box[12:], aad(comm.rank))
