#!/usr/bin/python3
"""Writes a tiny random Hugging Face model of one supported family and what a numpy forward pass makes of it.

    hf_family_reference.py CASE OUT_DIR

OUT_DIR gets config.json and model.safetensors (float32, random weights from a fixed seed), prompt.npy (int64
[P]), tokens.npy (the greedy continuation, int64 [G]) and logits.npy (float32 [P + G, vocab]: the prompt's
logits from one forward call over it, then one row per generated token fed back one at a time).

The forward pass below is written from the families' definitions (transformers' modeling files and
configuration docs), in float64, independently of namm's C++ engine; the test compares the two. As in
transformers' generate, the prompt runs in one call and each new token in its own, with a KV cache: under
dynamic NTK the keys keep the rotation of the call that computed them.
"""
import json
import math
import os
import struct
import sys

import numpy as np

DIM, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 48, 2, 4, 2, 64

# name -> (config.json fields on top of the base, prompt length, tokens generated)
CASES = {
    # Llama 3.1 frequency bands, and attention/MLP biases (attention_bias covers o_proj too).
    "llama3_rope": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": True,
                     "mlp_bias": True, "max_position_embeddings": 64,
                     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}, 20, 6),
    # YaRN as Qwen2.5 states it for long contexts: the trained length both as max_position_embeddings and in
    # rope_scaling; the blend's band edges fall between dimensions (truncate off) in the second case.
    "qwen2_yarn": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 256,
                    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}}, 20, 6),
    "llama_yarn_untruncated": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                "max_position_embeddings": 256,
                                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                                 "beta_slow": 2.0, "truncate": False,
                                                 "attention_factor": 1.2}}, 20, 6),
    # Dynamic NTK: the prompt already runs past the trained 16 positions, and every decoded token stretches more.
    # transformers v5's form: theta and the Llama 3.1 bands in one rope_parameters object, no rope_theta or
    # rope_scaling at the top level.
    "llama3_rope_parameters": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                "max_position_embeddings": 64,
                                "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                    "original_max_position_embeddings": 16}}, 20, 6),
    "llama_dynamic": ({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 16,
                       "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 20, 6),
    # Qwen2: q/k/v biases, tied embeddings, and a sliding_window that use_sliding_window false switches off.
    "qwen2": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": True,
               "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": 4,
               "max_window_layers": 1, "max_position_embeddings": 64}, 20, 6),
    # Qwen2 with the window on: layer 0 sees everything, layer 1 (>= max_window_layers) the last 6 positions.
    "qwen2_window": ({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                      "sliding_window": 6, "max_window_layers": 1, "max_position_embeddings": 64}, 20, 6),
    # Qwen3: per-head q/k RMSNorm, a head_dim (16) that is not hidden_size / heads (8).
    "qwen3": ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16,
               "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": None,
               "max_window_layers": 2, "max_position_embeddings": 64}, 20, 6),
    # Mistral v0.1-style sliding window on every layer.
    "mistral_window": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 5,
                        "max_position_embeddings": 64}, 20, 6),
}


def make_config(overrides):
    config = {"hidden_size": DIM, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
              "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2}
    config.update(overrides)
    if "rope_parameters" in config:
        del config["rope_theta"]
    return config


def head_dim(config):
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def make_weights(config, rng):
    """HF tensor names -> float32 arrays."""
    hd, family = head_dim(config), config["model_type"]
    q_out, kv_out = HEADS * hd, KV_HEADS * hd
    qkv_bias = family == "qwen2" or config.get("attention_bias", False)
    w = {"model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, DIM)), "model.norm.weight": 1 + rng.normal(0, 0.1, DIM)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = rng.normal(0, 0.5, (VOCAB, DIM))
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        w[p + "input_layernorm.weight"] = 1 + rng.normal(0, 0.1, DIM)
        w[p + "post_attention_layernorm.weight"] = 1 + rng.normal(0, 0.1, DIM)
        for name, shape in (("q_proj", (q_out, DIM)), ("k_proj", (kv_out, DIM)), ("v_proj", (kv_out, DIM)),
                            ("o_proj", (DIM, q_out))):
            w[p + f"self_attn.{name}.weight"] = rng.normal(0, 0.3, shape)
        if qkv_bias:
            for name, n in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
                w[p + f"self_attn.{name}.bias"] = rng.normal(0, 0.3, n)
        if config.get("attention_bias", False):
            w[p + "self_attn.o_proj.bias"] = rng.normal(0, 0.3, DIM)
        if family == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + rng.normal(0, 0.2, hd)
            w[p + "self_attn.k_norm.weight"] = 1 + rng.normal(0, 0.2, hd)
        for name, shape in (("gate_proj", (FFN, DIM)), ("up_proj", (FFN, DIM)), ("down_proj", (DIM, FFN))):
            w[p + f"mlp.{name}.weight"] = rng.normal(0, 0.3, shape)
            if config.get("mlp_bias", False):
                w[p + f"mlp.{name}.bias"] = rng.normal(0, 0.3, shape[0])
    return {k: v.astype(np.float32) for k, v in w.items()}


def write_safetensors(path, tensors):
    header, offset, blobs = {}, 0, []
    for name, array in tensors.items():
        data = np.ascontiguousarray(array, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


# ---- RoPE ------------------------------------------------------------------------------------------------------------

def rope_settings(config):
    """(theta, scaling): transformers v5's one rope_parameters object, else rope_theta and rope_scaling."""
    if config.get("rope_parameters"):
        return config["rope_parameters"]["rope_theta"], config["rope_parameters"]
    return config["rope_theta"], config.get("rope_scaling") or {}


def inverse_frequencies(config, sequence_length):
    d = head_dim(config)
    base, scaling = rope_settings(config)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor = scaling.get("factor", 1.0)
    trained = config["max_position_embeddings"]
    if kind == "dynamic" and sequence_length > trained:
        base = base * (factor * sequence_length / trained - (factor - 1)) ** (d / (d - 2))
    inv = 1.0 / base ** (np.arange(0, d, 2, dtype=np.float64) / d)
    if kind == "llama3":
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
                out.append((1 - smooth) * f / factor + smooth * f)
        inv = np.array(out)
    if kind == "yarn":
        length = scaling.get("original_max_position_embeddings", trained)

        def dimension(rotations):  # the dimension index whose frequency turns `rotations` times over `length`
            return d * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low, high = dimension(scaling.get("beta_fast", 32.0)), dimension(scaling.get("beta_slow", 1.0))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)  # 1 = fully interpolated
        inv = inv / factor * ramp + inv * (1 - ramp)
    return inv


def attention_scale(config):
    scaling = rope_settings(config)[1]
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    return scaling.get("attention_factor") or 0.1 * math.log(scaling["factor"]) + 1.0


def rotate(x, positions, inv, scale):
    """x [heads, t, d], rotate-half convention."""
    angles = positions[:, None] * inv[None, :]
    angles = np.concatenate([angles, angles], axis=1)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(angles) * scale + rotated * np.sin(angles) * scale


# ---- forward ---------------------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def linear(x, w, name):
    y = x @ w[name + ".weight"].T.astype(np.float64)
    return y + w[name + ".bias"] if name + ".bias" in w else y


def window_of(config, layer):
    family = config["model_type"]
    window = config.get("sliding_window")
    if family in ("qwen2", "qwen3"):
        if not config.get("use_sliding_window", False) or layer < config.get("max_window_layers", 0):
            return None
    return window


def forward(config, w, tokens, cache):
    """Runs `tokens` after the cache's sequence; returns logits [t, vocab]. cache: per layer (keys, values, pos)."""
    eps, hd = config["rms_norm_eps"], head_dim(config)
    start = len(cache[0][2]) if cache[0] else 0
    t = len(tokens)
    positions = np.arange(start, start + t, dtype=np.float64)
    inv, scale = inverse_frequencies(config, start + t), attention_scale(config)
    x = w["model.embed_tokens.weight"][tokens].astype(np.float64)
    for l in range(LAYERS):
        p = f"model.layers.{l}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = linear(h, w, p + "self_attn.q_proj").reshape(t, HEADS, hd)
        k = linear(h, w, p + "self_attn.k_proj").reshape(t, KV_HEADS, hd)
        v = linear(h, w, p + "self_attn.v_proj").reshape(t, KV_HEADS, hd).transpose(1, 0, 2)
        if config["model_type"] == "qwen3":
            q = rms_norm(q, w[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, w[p + "self_attn.k_norm.weight"], eps)
        q = rotate(q.transpose(1, 0, 2), positions, inv, scale)
        k = rotate(k.transpose(1, 0, 2), positions, inv, scale)
        if cache[l]:
            old_k, old_v, old_pos = cache[l]
            k, v = np.concatenate([old_k, k], axis=1), np.concatenate([old_v, v], axis=1)
            key_pos = np.concatenate([old_pos, positions])
        else:
            key_pos = positions
        cache[l] = (k, v, key_pos)
        group = HEADS // KV_HEADS
        k_heads, v_heads = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)
        scores = q @ k_heads.transpose(0, 2, 1) / math.sqrt(hd)  # [heads, t, n]
        behind = positions[:, None] - key_pos[None, :]
        visible = behind >= 0
        window = window_of(config, l)
        if window:
            visible &= behind < window
        scores = np.where(visible[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        attended = (probs @ v_heads).transpose(1, 0, 2).reshape(t, HEADS * hd)
        x = x + linear(attended, w, p + "self_attn.o_proj")
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = linear(h, w, p + "mlp.gate_proj"), linear(h, w, p + "mlp.up_proj")
        x = x + linear(gate / (1 + np.exp(-gate)) * up, w, p + "mlp.down_proj")
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).astype(np.float64)
    return rms_norm(x, w["model.norm.weight"], eps) @ head.T


def main():
    if len(sys.argv) != 3 or sys.argv[1] not in CASES:
        sys.exit(f"usage: {sys.argv[0]} CASE OUT_DIR (cases: {', '.join(CASES)})")
    name, out = sys.argv[1], sys.argv[2]
    overrides, prompt_length, generated = CASES[name]
    config = make_config(overrides)
    rng = np.random.default_rng(sorted(CASES).index(name) + 1)
    weights = make_weights(config, rng)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    write_safetensors(os.path.join(out, "model.safetensors"), weights)

    prompt = rng.integers(3, VOCAB, prompt_length).astype(np.int64)
    cache = [None] * LAYERS
    rows = [forward(config, weights, prompt, cache)]
    tokens = []
    for _ in range(generated):
        tokens.append(int(np.argmax(rows[-1][-1])))
        rows.append(forward(config, weights, np.array(tokens[-1:]), cache))
    np.save(os.path.join(out, "prompt.npy"), prompt)
    np.save(os.path.join(out, "tokens.npy"), np.array(tokens, dtype=np.int64))
    np.save(os.path.join(out, "logits.npy"), np.concatenate(rows).astype(np.float32))


if __name__ == "__main__":
    main()
