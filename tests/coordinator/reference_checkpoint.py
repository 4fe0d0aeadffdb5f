"""The reference's side of the ckpt.pt round trip, with Debian's python3-torch (reference_checkpoint_test.cpp).

  write OUT.pt OUT.json   torch.save a checkpoint laid out as the reference's _save_ckpt does (an OrderedDict
                          state dict of float32 nn.Parameters, N = 4172, lambda = 32), and the numbers namm must
                          import from it as JSON.
  check CKPT.pt IN.json   torch.load a checkpoint namm wrote and check every entry against IN.json: the key set,
                          float32 dtypes, shapes, and values.
"""
import collections
import json
import sys

import torch

STATS = "stored_buffers_to_save.token_embedding_0_"
N, LAMBDA = 4172, 32


def write(out_pt, out_json):
    g = torch.Generator().manual_seed(7)
    p = lambda t: torch.nn.Parameter(t.float(), requires_grad=False)
    # The mean a strided view into a larger storage (offset 1, stride 2): namm must follow offset and strides.
    mean = (torch.randn(2 * N + 1, generator=g) * 0.05)[1::2]
    best = torch.randn(N, generator=g) * 0.05
    stats_mean = torch.rand(1, 1, 1, 17, generator=g)
    stats_var = torch.rand(1, 1, 1, 17, generator=g) + 0.1
    state = collections.OrderedDict()
    state["mu_eff"] = p(torch.tensor(9.178829))
    state["weights"] = p(torch.linspace(0.2, -0.12, LAMBDA))
    state["weights_truncated"] = p(torch.cat([torch.linspace(0.2, 0.002, 16), torch.zeros(16)]))
    state["g"] = p(torch.tensor(12.0))
    state["best_member"] = p(best)
    state["best_fitness"] = p(torch.tensor(1.25))
    state["evo_path_c"] = p(torch.zeros(N))
    state["evo_path_sigma"] = p(torch.zeros(N))
    state["mean"] = p(mean)
    state["sigma"] = p(torch.tensor(0.0643))
    eye = torch.eye(N)
    state["C"] = p(eye)
    state["sample_C"] = p(eye)
    state["sample_B"] = p(eye.t())
    state["sample_D"] = p(torch.ones(N))
    state["x"] = p(torch.zeros(LAMBDA, N))
    state["y"] = p(torch.zeros(LAMBDA, N))
    for s in ("mean", "var", "num"):
        state[STATS + "online_new_output_" + s] = p(torch.tensor(0.0))
    state[STATS + "output_mean"] = p(stats_mean)
    state[STATS + "output_var"] = p(stats_var)
    state[STATS + "output_num"] = p(torch.full((1, 1, 1, 17), 123456.0))
    state._metadata = collections.OrderedDict()  # as Module.state_dict() leaves it
    torch.save({"evolution_state": state, "iter_num": 12, "best_val_loss": 1.1875}, out_pt)
    json.dump({"mean": mean.tolist(), "best_member": best.tolist(), "sigma": 0.0643, "g": 12,
               "iter_num": 12, "best_val_loss": 1.1875, "stats_mean": stats_mean.flatten().tolist(),
               "stats_var": stats_var.flatten().tolist(), "stats_num": 123456}, open(out_json, "w"))


def check(ckpt, expected_json):
    e = json.load(open(expected_json))
    c = torch.load(ckpt)
    assert set(c) == {"evolution_state", "iter_num", "best_val_loss"}, set(c)
    assert c["iter_num"] == e["iter_num"], c["iter_num"]
    assert abs(c["best_val_loss"] - e["best_val_loss"]) < 1e-12, c["best_val_loss"]
    s = c["evolution_state"]
    expected_keys = {"mu_eff", "weights", "weights_truncated", "g", "best_member", "best_fitness", "evo_path_c",
                     "evo_path_sigma", "mean", "sigma", "C", "sample_C", "sample_B", "sample_D", "x", "y"}
    expected_keys |= {STATS + k + s for k in ("online_new_output_", "output_") for s in ("mean", "var", "num")}
    assert set(s) == expected_keys, set(s) ^ expected_keys
    for k, v in s.items():
        assert v.dtype == torch.float32, (k, v.dtype)
        assert torch.isfinite(v).all(), k
    n, lam = e["n"], e["lambda"]
    shapes = {"mu_eff": (), "g": (), "sigma": (), "best_fitness": (), "weights": (lam,), "weights_truncated": (lam,),
              "best_member": (n,), "evo_path_c": (n,), "evo_path_sigma": (n,), "mean": (n,), "sample_D": (n,),
              "C": (n, n), "sample_C": (n, n), "sample_B": (n, n), "x": (lam, n), "y": (lam, n)}
    for k, shape in shapes.items():
        assert tuple(s[k].shape) == shape, (k, tuple(s[k].shape), shape)
    close = lambda k, v: torch.allclose(s[k].double(), torch.tensor(v, dtype=torch.float64).reshape(s[k].shape),
                                        rtol=1e-6, atol=1e-7)
    for k in ("mean", "best_member", "evo_path_c", "evo_path_sigma", "weights", "C", "sample_D"):
        assert close(k, e[k]), k
    for k in ("mu_eff", "sigma", "best_fitness", "g"):
        assert close(k, [e[k]]), (k, float(s[k]), e[k])
    # B D^2 B^T reproduces C, and the truncated weights are the positive ones.
    b, d = s["sample_B"].double(), s["sample_D"].double()
    assert torch.allclose(b @ torch.diag(d * d) @ b.t(), s["C"].double(), atol=1e-5), "B D^2 B^T != C"
    w = s["weights"]
    assert torch.equal(s["weights_truncated"], torch.where(torch.arange(lam) < e["mu"], w, torch.zeros_like(w)))
    assert close(STATS + "output_mean", e["stats_mean"]) and close(STATS + "output_var", e["stats_var"])
    assert (s[STATS + "output_num"] == e["stats_num"]).all()
    assert (s["x"] == 0).all() and (s["y"] == 0).all()
    print("checked", len(s), "entries")


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]](sys.argv[2], sys.argv[3])
