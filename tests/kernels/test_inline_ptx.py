"""The kernels' inline PTX, run by a small emulator of the instructions it uses.

Triton's interpreter takes the kernels' pure-Triton branches, and a machine without a GPU can
compile the assembly but not run it, so these tests evaluate the assembly text itself, as the
kernels emit it (each block built by a ``triton.constexpr_function``), by the PTX ISA's
definitions: ``prmt`` (default mode), ``lop3``, ``mov``, ``shl``, ``and``,
``ld.global.nc.v4.b32`` and ``fma.rn`` on ``f16x2`` and ``bf16x2``, each packed half rounded to
nearest even.
"""

from __future__ import annotations

import math
import random
import re
import struct
from fractions import Fraction
from functools import cache

import pytest
import torch

from lowbit.kernels.int_gemv import pair_bias, pair_decode_asm
from lowbit.kernels.mixed_gemv import load_x8_asm

MASK32 = 0xFFFFFFFF


#: the 16-bit float formats of packed halves, by their PTX names
HALVES = {"f16": torch.float16, "bf16": torch.bfloat16}


@cache
def _half_value(bits: int, fmt: str) -> Fraction:
    """The exact value of a 16-bit float's ``bits`` (``fmt`` "f16" or "bf16"), finite only."""
    value = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(HALVES[fmt]).item()
    assert math.isfinite(value), "the emulator takes finite halves only"
    return Fraction(value)


@cache
def _half_bits(value: Fraction, fmt: str) -> int:
    """``value`` rounded to nearest even in ``fmt``, as bits (exact in float64 first, checked)."""
    wide = float(value)
    assert Fraction(wide) == value, "a sum that float64 cannot hold exactly: extend the emulator"
    half = torch.tensor(wide, dtype=torch.float64).to(HALVES[fmt])
    return int(half.view(torch.int16).item()) & 0xFFFF


def _prmt(a: int, b: int, select: int) -> int:
    """``prmt.b32`` default mode: byte ``i`` of the result is byte ``select[i] & 7`` of
    ``{b, a}``, or that byte's sign replicated where ``select[i] & 8``."""
    source = a | b << 32
    out = 0
    for i in range(4):
        nibble = select >> (4 * i) & 0xF
        byte = source >> (8 * (nibble & 7)) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """``lop3.b32``: bit ``i`` of the result is bit ``4a + 2b + c`` of ``lut`` (its bits at i)."""
    out = 0
    for term in range(8):
        if lut >> term & 1:
            out |= (a if term & 4 else ~a) & (b if term & 2 else ~b) & (c if term & 1 else ~c)
    return out & MASK32


def _fma_x2(a: int, b: int, c: int, fmt: str) -> int:
    """``fma.rn.{f16x2, bf16x2}``: each 16-bit half ``a * b + c``, rounded once."""
    out = 0
    for shift in (0, 16):
        x, y, z = (_half_value(v >> shift & 0xFFFF, fmt) for v in (a, b, c))
        out |= _half_bits(x * y + z, fmt) << shift
    return out


def emulate(asm: str, operands: dict[int, int], memory: bytes = b"") -> dict[int, int]:
    """Run ``asm`` (one inline-PTX block) on ``operands`` (``$i`` -> register bits; an address
    operand indexes ``memory``); returns every ``$i`` it writes."""
    regs = {f"${i}": v for i, v in operands.items()}

    def value(token: str) -> int:
        token = token.strip()
        return int(token, 0) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", token) else regs[token]

    body = asm.strip()
    assert body.startswith("{") and body.endswith("}"), "one braced block"
    written = set()
    for statement in body[1:-1].split(";"):
        statement = statement.strip()
        if not statement or statement.startswith(".reg"):
            continue
        op, _, rest = statement.partition(" ")
        if rest.startswith("{"):  # a vector destination
            vector, _, rest = rest[1:].partition("}")
            dests = [d.strip() for d in vector.split(",")]
            args = [a.strip() for a in rest.lstrip(", ").split(",")]
        else:
            dest, *args = (t.strip() for t in rest.split(","))
            dests = [dest]
        if op == "ld.global.nc.v4.b32":
            address = value(args[0].strip("[]"))
            words = struct.unpack_from("<4I", memory, address)
            results = list(words)
        elif op == "mov.b32" and len(dests) == 2:  # a register's halves, low first
            word = value(args[0])
            results = [word & 0xFFFF, word >> 16]
        elif op == "mov.b32":
            results = [value(args[0]) & MASK32]
        elif op == "shl.b32":
            results = [value(args[0]) << value(args[1]) & MASK32]
        elif op == "and.b32":
            results = [value(args[0]) & value(args[1]) & MASK32]
        elif op == "prmt.b32":
            results = [_prmt(*(value(a) for a in args))]
        elif op == "lop3.b32":
            results = [_lop3(*(value(a) for a in args))]
        elif op in ("fma.rn.f16x2", "fma.rn.bf16x2"):
            results = [_fma_x2(*(value(a) for a in args), op.split(".")[-1][:-2])]
        else:
            raise NotImplementedError(f"the emulator has no {op}")
        for dest, result in zip(dests, results, strict=True):
            regs[dest] = result
            written.add(dest)
    return {int(d[1:]): regs[d] for d in written if d.startswith("$")}


def _pack(low: int, high: int) -> int:
    return low | high << 16


def _pair_cases(bits: int, rng: random.Random) -> list[int]:
    """Words where every slot takes every code, and random ones."""
    codes = 1 << bits
    every = [sum((s + k) % codes << (s * bits) for s in range(32 // bits)) for k in range(codes)]
    return every + [rng.getrandbits(32) for _ in range(8)]


PAIRED = [(b, bf16) for b in (2, 4, 8) for bf16 in (False, True) if not (bf16 and b == 8)]


@pytest.mark.parametrize("bits, bf16", PAIRED)
def test_pair_decode_asm_gives_each_elements_code_minus_its_zero(bits, bf16):
    """``int_gemv._decode_pair``'s assembly, slot by slot: each half of the result is the code
    of its own element at the slot, minus its own zero, exactly, for every code (the two
    elements need not be one word's pair: Triton chooses which two it hands the asm)."""
    fmt = "bf16" if bf16 else "f16"
    rng = random.Random(bits)
    words = _pair_cases(bits, rng)
    mask = (1 << bits) - 1  # every zero below 8 bits; at 8 the ends, the middle and a sample
    some = range(mask + 1) if bits < 8 else [0, 1, 127, 128, 254, 255, *rng.sample(range(mask), 4)]
    zeros = [(z, (z * 5 + 3) & mask) for z in some]
    neighbours = list(zip(words[:-1], words[1:], strict=True))
    for slot in range(0, 32 // bits, 2):
        asm = pair_decode_asm(slot, bits, bf16)
        bias = pair_bias(slot, bits, bf16)
        for zero_a, zero_b in zeros:
            neg = [_half_bits(-Fraction(z) - Fraction(bias), fmt) for z in (zero_a, zero_b)]
            for a, b in [(w, w >> bits) for w in words] + neighbours:
                out = emulate(asm, {1: a, 2: b, 3: _pack(*neg)})[0]
                got = [_half_value(out & 0xFFFF, fmt), _half_value(out >> 16, fmt)]
                want = [(a >> (slot * bits) & mask) - zero_a, (b >> (slot * bits) & mask) - zero_b]
                assert got == want, (slot, hex(a), hex(b), zero_a, zero_b)


def test_pair_decode_asm_is_wrong_for_8_bit_bf16_codes():
    """Why the paired decode leaves 8-bit bf16 alone: bf16's ``128 + code`` holds codes below
    128 only, and the emulator sees the code's bit 7 land in the exponent."""
    asm, bias = pair_decode_asm(0, 8, True), pair_bias(0, 8, True)
    neg = _half_bits(-Fraction(bias), "bf16")
    out = emulate(asm, {1: 200, 2: 100, 3: _pack(neg, neg)})[0]
    assert _half_value(out >> 16, "bf16") == 100  # below 128: exact
    assert _half_value(out & 0xFFFF, "bf16") != 200


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_load_x8_asm_reads_eight_activations_in_order(dtype):
    """``mixed_gemv._load_x8``'s assembly: eight 16-bit activations from one 16-byte load, in
    memory order; fp16 as its bits, bf16 widened to fp32 exactly."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(16, generator=generator).to(dtype)
    x[3], x[12] = -0.0, torch.finfo(dtype).tiny / 4  # a negative zero, a subnormal
    memory = x.view(torch.int16).numpy().tobytes()
    bf16 = dtype == torch.bfloat16
    for start in (0, 8):  # two aligned vectors
        out = emulate(load_x8_asm(bf16), {8: 2 * start}, memory)
        got = [out[i] for i in range(8)]
        want = x[start : start + 8]
        if bf16:
            want_bits = want.to(torch.float32).view(torch.int32).tolist()
            assert got == [w & MASK32 for w in want_bits]
        else:
            assert got == [w & 0xFFFF for w in want.view(torch.int16).tolist()]
