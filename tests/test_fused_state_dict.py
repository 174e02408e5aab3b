"""A fused model's and optimizer's state_dict() save like unfused ones (issue 12, item 6).

After fuse_optimizer every parameter is a view of one flat buffer; torch.save of a view
writes its whole storage, safetensors refuses shared storages, and a loaded view keeps the
whole loaded buffer alive. These tests compare byte sizes with the unfused model and check
that loading into a fused model keeps training fused and exact.
"""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch

from bagua_integrations import fuse_optimizer, fusion_report, unfuse
from bagua_integrations._state_dict import compact_fused_parameters

SEED = 0


class Net(torch.nn.Module):
    """Four small layers and one 256x256 layer, all in one flat buffer once fused."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(SEED)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))
        self.big = torch.nn.Linear(256, 256)
        self.head = torch.nn.Linear(64, 256)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.big(self.head(x))


def data(steps, seed=SEED + 1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=gen), torch.randn(8, 256, generator=gen)) for _ in range(steps)]


def train(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def pair(steps=2, lr=1e-2):
    """(unfused model, its AdamW, fused model, fused AdamW), both trained ``steps`` steps."""
    plain, fused = Net(), Net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=lr)
    fused_opt = fuse_optimizer(torch.optim.AdamW(fused.parameters(), lr=lr), replace_step=True)
    batches = data(steps)
    train(plain, plain_opt, batches)
    train(fused, fused_opt, batches)
    return plain, plain_opt, fused, fused_opt


def saved_bytes(obj) -> int:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return len(buffer.getvalue())


def round_trip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def is_whole_storage(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == t.numel() * t.element_size()


def assert_close_size(fused: int, plain: int, what: str, tolerance=0.03):
    assert fused <= plain * (1 + tolerance), f"{what}: fused saves {fused:,} bytes, unfused {plain:,}"


# ----------------------------------------------------------------------------- model
def test_the_model_is_really_fused():
    _, _, fused, opt = pair()
    assert fusion_report(opt).fused_params == len(list(fused.parameters()))
    storages = {p.untyped_storage().data_ptr() for p in fused.parameters()}
    assert len(storages) == 1


def test_one_layers_state_dict_saves_like_the_unfused_layer():
    plain, _, fused, _ = pair()
    plain_bytes = saved_bytes(plain.layers[1].state_dict())
    fused_bytes = saved_bytes(fused.layers[1].state_dict())
    assert_close_size(fused_bytes, plain_bytes, "layers[1].state_dict()")
    assert plain_bytes < 40_000  # 64x64 + 64 floats: the whole flat buffer would be about 300 kB


def test_a_256x256_weight_saves_like_the_unfused_weight():
    plain, _, fused, _ = pair()
    plain_bytes = saved_bytes(plain.state_dict()["big.weight"])
    fused_bytes = saved_bytes(fused.state_dict()["big.weight"])
    assert_close_size(fused_bytes, plain_bytes, "state_dict()['big.weight']")
    assert fused_bytes < 300_000  # 256 KiB of floats, not the whole flat buffer
    assert_close_size(saved_bytes(fused.big.state_dict()), saved_bytes(plain.big.state_dict()), "big.state_dict()")


def test_the_whole_model_saves_like_the_unfused_model():
    plain, _, fused, _ = pair()
    assert_close_size(saved_bytes(fused.state_dict()), saved_bytes(plain.state_dict()), "state_dict()")


def test_state_dict_values_are_compact_copies_with_the_parameters_values():
    _, _, fused, _ = pair()
    state = fused.state_dict()
    for name, param in fused.named_parameters():
        assert is_whole_storage(state[name]), name
        assert torch.equal(state[name], param.detach()), name
        assert state[name].data_ptr() != param.data_ptr(), name
        assert not state[name].requires_grad


def test_keep_vars_returns_the_parameters_themselves():
    _, _, fused, _ = pair()
    state = fused.state_dict(keep_vars=True)
    for name, param in fused.named_parameters():
        assert state[name] is param


def test_a_loaded_tensor_owns_only_its_own_storage():
    _, _, fused, _ = pair()
    loaded = round_trip(fused.layers[2].state_dict())
    for name, tensor in loaded.items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
    loaded = round_trip(fused.state_dict())
    assert all(is_whole_storage(t) for t in loaded.values())


def test_safetensors_saves_and_loads_a_fused_model(tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    plain, _, fused, _ = pair()
    safetensors_torch.save_file(fused.state_dict(), str(tmp_path / "fused.safetensors"))
    safetensors_torch.save_file(plain.state_dict(), str(tmp_path / "plain.safetensors"))
    fused_size = (tmp_path / "fused.safetensors").stat().st_size
    plain_size = (tmp_path / "plain.safetensors").stat().st_size
    assert fused_size == plain_size
    safetensors_torch.save_model(fused, str(tmp_path / "model.safetensors"))
    saved = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    for name, param in fused.named_parameters():
        assert torch.equal(saved[name], param.detach()), name
    # load_model into a fused model: values copied into the flat buffer, parameters stay views
    ptrs = [p.data_ptr() for p in fused.parameters()]
    other = Net()
    safetensors_torch.save_model(other, str(tmp_path / "other.safetensors"))
    safetensors_torch.load_model(fused, str(tmp_path / "other.safetensors"))
    assert [p.data_ptr() for p in fused.parameters()] == ptrs
    for p, q in zip(fused.parameters(), other.parameters()):
        assert torch.equal(p, q)


def test_tied_weights_stay_one_tensor_in_the_state_dict():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(SEED)
            self.embed = torch.nn.Embedding(50, 16)
            self.hidden = torch.nn.Linear(16, 16)
            self.out = torch.nn.Linear(16, 50, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(torch.tanh(self.hidden(self.embed(ids))))

    plain, fused = Tied(), Tied()
    opt = fuse_optimizer(torch.optim.AdamW(fused.parameters(), lr=1e-2), replace_step=True)
    assert fusion_report(opt).fused_params == 3
    ids = torch.randint(0, 50, (4, 5), generator=torch.Generator().manual_seed(1))
    for model, optimizer in ((plain, torch.optim.AdamW(plain.parameters(), lr=1e-2)), (fused, opt)):
        model(ids).sum().backward()
        optimizer.step()
    state = fused.state_dict()
    assert state["out.weight"] is state["embed.weight"]
    assert is_whole_storage(state["embed.weight"])
    assert_close_size(saved_bytes(state), saved_bytes(plain.state_dict()), "tied state_dict()")
    # a reused destination gets fresh copies (the weights changed since)
    fused(ids).sum().backward()
    opt.step()
    again = fused.state_dict(destination=state)
    assert again["out.weight"] is again["embed.weight"]
    assert torch.equal(again["embed.weight"], fused.embed.weight.detach())


def test_load_state_dict_into_a_fused_model_keeps_training_fused_and_exact():
    """Resume a fused model from an unfused checkpoint (and from a fused one): same as unfused."""
    plain, plain_opt, fused_src, fused_src_opt = pair(steps=3)
    checkpoint = round_trip({"model": plain.state_dict(), "optimizer": plain_opt.state_dict()})
    fused_checkpoint = round_trip({"model": fused_src.state_dict(), "optimizer": fused_src_opt.state_dict()})

    more = data(3, seed=SEED + 7)
    train(plain, plain_opt, more)  # the uninterrupted unfused reference
    for source in (checkpoint, fused_checkpoint):
        model = Net()
        opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), replace_step=True)
        ptrs = [p.data_ptr() for p in model.parameters()]
        model.load_state_dict(source["model"])
        opt.load_state_dict(source["optimizer"])
        assert [p.data_ptr() for p in model.parameters()] == ptrs  # still views of the flat buffer
        train(model, opt, more)
        report = fusion_report(opt)
        assert report.last_step_fused and report.unfused_params == 0
        assert [p.data_ptr() for p in model.parameters()] == ptrs
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_sub_module_state_dict_loads_into_a_fused_sub_module():
    plain, _, fused, _ = pair()
    ptrs = [p.data_ptr() for p in fused.parameters()]
    fused.big.load_state_dict(round_trip(plain.big.state_dict()))
    assert torch.equal(fused.big.weight, plain.big.weight)
    assert [p.data_ptr() for p in fused.parameters()] == ptrs


# ----------------------------------------------------------------------------- optimizer
def test_optimizer_state_dict_saves_like_the_unfused_one():
    plain, plain_opt, fused, fused_opt = pair()
    assert_close_size(saved_bytes(fused_opt.state_dict()), saved_bytes(plain_opt.state_dict()), "optimizer")


def test_optimizer_state_of_a_partly_trained_model_saves_like_the_unfused_one():
    """Parameters without state (no gradient yet): their slots of the flat state are not saved."""
    plain, fused = Net(), Net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    fused_opt = fuse_optimizer(torch.optim.AdamW(fused.parameters(), lr=1e-2), replace_step=True)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    for model, optimizer in ((plain, plain_opt), (fused, fused_opt)):
        h = x
        for layer in model.layers:  # big and head get no gradient, so no state
            h = torch.tanh(layer(h))
        h.sum().backward()
        optimizer.step()
    plain_bytes, fused_bytes = saved_bytes(plain_opt.state_dict()), saved_bytes(fused_opt.state_dict())
    assert_close_size(fused_bytes, plain_bytes, "optimizer state with stateless parameters")
    assert plain_bytes < 200_000  # the flat state buffers would be about 1.2 MB
    for entry in round_trip(fused_opt.state_dict())["state"].values():
        assert is_whole_storage(entry["exp_avg"]) and is_whole_storage(entry["exp_avg_sq"])
    # the optimizer's own state is untouched: still views of the flat state
    for state in fused_opt.state.values():
        assert not is_whole_storage(state["exp_avg"])


def test_fully_covered_flat_state_is_not_copied():
    """A checkpoint of the whole state does not double the optimizer's memory: views are kept."""
    _, _, _, fused_opt = pair()
    saved = fused_opt.state_dict()["state"]
    for index, param in enumerate(p for g in fused_opt.param_groups for p in g["params"]):
        assert saved[index]["exp_avg"] is fused_opt.state[param]["exp_avg"]


def test_fused_optimizer_state_dict_loads_into_the_unfused_class():
    plain, plain_opt, fused, fused_opt = pair()
    state = round_trip(fused_opt.state_dict())
    fresh = torch.optim.AdamW(Net().parameters(), lr=1e-2)
    fresh.load_state_dict(state)
    for a, b in zip(fresh.state.values(), plain_opt.state.values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"])


# ----------------------------------------------------------------------------- hooks' lifetime
def hooked(module) -> bool:
    return compact_fused_parameters in module._state_dict_hooks.values()


def test_unfuse_removes_the_state_dict_hooks():
    _, _, fused, opt = pair()
    assert all(hooked(m) for m in (fused.big, fused.head, *fused.layers))
    assert not hooked(fused)  # only modules that own fused parameters
    unfuse(opt)
    assert not any(hooked(m) for m in fused.modules())
    # the parameters are still views of the flat memory: saved as such again, like any view
    assert not is_whole_storage(fused.big.state_dict()["weight"])


def test_a_collected_optimizer_releases_the_state_dict_hooks():
    _, _, fused, opt = pair()
    del opt
    gc.collect()
    assert not any(hooked(m) for m in fused.modules())


def test_a_param_group_added_after_fusing_saves_compactly():
    model = Net()
    extra = torch.nn.Linear(64, 64)
    opt = fuse_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), replace_step=True)
    opt.add_param_group({"params": list(extra.parameters())})
    x = torch.randn(8, 64)
    (model(x).sum() + extra(x).sum()).backward()
    opt.step()
    assert not is_whole_storage(extra.weight)  # laid out into a flat buffer
    assert all(is_whole_storage(t) for t in extra.state_dict().values())


def test_deepcopy_and_pickle_of_a_fused_model_still_work():
    _, _, fused, _ = pair()
    clone = copy.deepcopy(fused)
    assert torch.equal(clone.big.weight, fused.big.weight)
    whole = round_trip_module(fused)
    assert torch.equal(whole.big.weight, fused.big.weight)


def round_trip_module(module):
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


# ----------------------------------------------------------------------------- transformers
def test_save_pretrained_of_a_fused_model_with_tied_embeddings(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=32,
    )
    torch.manual_seed(SEED)
    plain = transformers.BertForMaskedLM(config)
    fused = copy.deepcopy(plain)
    opt = fuse_optimizer(torch.optim.AdamW(fused.parameters(), lr=1e-2), replace_step=True)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    fused(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    plain.load_state_dict(fused.state_dict())
    fused.save_pretrained(tmp_path / "fused")
    plain.save_pretrained(tmp_path / "plain")
    fused_size = (tmp_path / "fused" / "model.safetensors").stat().st_size
    plain_size = (tmp_path / "plain" / "model.safetensors").stat().st_size
    assert fused_size == plain_size
    reloaded = transformers.BertForMaskedLM.from_pretrained(tmp_path / "fused")
    for (name, p), q in zip(fused.named_parameters(), reloaded.parameters()):
        assert torch.equal(p, q), name
