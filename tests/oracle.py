"""Independent numpy oracle of the record formats (ml_dtypes for the narrow floats).

Written from the format specification, not from the library code: per-element Python-level
loops over tiles/groups, numpy float32 arithmetic (IEEE, no flushing).  `flush_subnormals`
models XLA on CPU, which treats float32 subnormal inputs as signed zeros.
"""
import ml_dtypes
import numpy as np

F32_TINY = np.float32(np.finfo(np.float32).tiny)


def _flush(x):
    return np.where(np.abs(x) < F32_TINY, np.copysign(np.float32(0), x), x).astype(np.float32)


def _amax(v):
    v = np.abs(v[~np.isnan(v)])
    return np.float32(v.max()) if v.size else np.float32(0)


@np.errstate(invalid="ignore", over="ignore")
def _e4m3_byte(v):
    v = np.float32(v)
    if np.isnan(v):
        return 0x7F
    v = np.float32(min(max(v, np.float32(-448)), np.float32(448)))
    return int(np.array(v, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def _e2m1_code(v):
    v = np.float32(v)
    if np.isnan(v):
        return 0x7
    c = np.array(min(max(v, np.float32(-6)), np.float32(6)), np.float32).astype(ml_dtypes.float4_e2m1fn)
    code = int(c.view(np.uint8)) & 0xF
    if np.signbit(v):
        code |= 0x8
    return code


@np.errstate(invalid="ignore", divide="ignore", over="ignore")
def encode_fp8_ds_mla(kv_c, k_pe, flush_subnormals=False):
    """kv_c f32[T,512] (values exactly representable), k_pe bf16[T,64] -> u8[T,656]."""
    kv_c = np.asarray(kv_c, np.float32)
    if flush_subnormals:
        kv_c = _flush(kv_c)
    t = kv_c.shape[0]
    out = np.zeros((t, 656), np.uint8)
    for i in range(t):
        scales = np.zeros(4, np.float32)
        for tile in range(4):
            x = kv_c[i, 128 * tile:128 * (tile + 1)]
            s = np.float32(_amax(x) / np.float32(448))
            s = max(s, F32_TINY) if not np.isnan(s) else s
            scales[tile] = s
            for j, v in enumerate(x):
                out[i, 128 * tile + j] = _e4m3_byte(np.float32(v) / s)
        out[i, 512:528] = scales.view(np.uint8)
        out[i, 528:656] = np.asarray(k_pe[i]).view(np.uint8)
    return out


@np.errstate(invalid="ignore", divide="ignore", over="ignore")
def encode_nvfp4_ds_mla(kv_c, k_pe, flush_subnormals=False):
    """kv_c f32[T,512], k_pe bf16[T,64] -> u8[T,432]."""
    kv_c = np.asarray(kv_c, np.float32)
    if flush_subnormals:
        kv_c = _flush(kv_c)
    t = kv_c.shape[0]
    out = np.zeros((t, 432), np.uint8)
    for i in range(t):
        codes = np.zeros(512, np.uint8)
        for g in range(32):
            x = kv_c[i, 16 * g:16 * (g + 1)]
            sf = _e4m3_byte(_amax(x) / np.float32(6))
            out[i, 256 + g] = sf
            sf_val = np.float32(np.array(sf, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))
            inv = np.float32(0) if sf_val == 0 else np.float32(np.float32(1) / sf_val)
            for j, v in enumerate(x):
                codes[16 * g + j] = _e2m1_code(np.float32(v) * inv)
        out[i, 0:256] = codes[0::2] | (codes[1::2] << 4)
        out[i, 304:432] = np.asarray(k_pe[i]).view(np.uint8)
    return out


def encode_bf16(kv_c, k_pe, flush_subnormals=False):
    """kv_c [T,512] (any float), k_pe bf16[T,64] -> u8[T,1152]."""
    del flush_subnormals  # a bit copy / conversion, no arithmetic
    nope = np.asarray(kv_c).astype(ml_dtypes.bfloat16)
    return np.concatenate([nope.view(np.uint8), np.asarray(k_pe).view(np.uint8)], axis=1)


ENCODERS = {"fp8_ds_mla": encode_fp8_ds_mla, "nvfp4_ds_mla": encode_nvfp4_ds_mla, "bf16": encode_bf16}


@np.errstate(invalid="ignore", over="ignore")
def decode(name, records):
    """u8[T, R] -> f32[T, 576]."""
    records = np.asarray(records, np.uint8)
    t = records.shape[0]
    if name == "bf16":
        return records.view(ml_dtypes.bfloat16).astype(np.float32).reshape(t, 576)
    rope_off = 528 if name == "fp8_ds_mla" else 304
    rope = np.ascontiguousarray(records[:, rope_off:rope_off + 128]).view(ml_dtypes.bfloat16).astype(np.float32)
    if name == "fp8_ds_mla":
        q = records[:, :512].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = np.ascontiguousarray(records[:, 512:528]).view(np.float32)
        nope = q * np.repeat(s, 128, axis=1)
    else:
        codes = np.stack([records[:, :256] & 0xF, records[:, :256] >> 4], axis=-1).reshape(t, 512)
        mags = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], np.float32)[codes & 7]
        vals = np.where(codes & 8, -mags, mags)
        s = records[:, 256:288].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        nope = vals * np.repeat(s, 16, axis=1)
    return np.concatenate([nope, rope], axis=1)
