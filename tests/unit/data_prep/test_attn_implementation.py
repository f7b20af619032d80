"""`target.attn_implementation`: the attention a user asks for reaches the loaded target, null
keeps transformers' default, a name transformers would not take is one line naming the setting,
and draftsmith's own forwards (capture, the decoders), which hand the target dense masks, refuse
an attention that does not read them. Also where the weights load: on a GPU, straight onto it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from conf.errors import UserError
from conf.schema import RootConfig, TargetConfig
from data_prep.masks import attention_layout
from data_prep.states.capture import attention_masks, causal_mask
from data_prep.target import resolve_target


def target(folder, **settings):
    config = TargetConfig(name_or_path=str(folder), device="cpu", num_threads=1, **settings)
    return resolve_target(RootConfig(target=config))


def test_the_setting_reaches_the_loaded_target_and_null_keeps_the_default(tiny_llama_dir):
    default = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).config._attn_implementation
    assert default == "sdpa"
    assert target(tiny_llama_dir).load_model().config._attn_implementation == default
    eager = target(tiny_llama_dir, attn_implementation="eager").load_model()
    assert eager.config._attn_implementation == "eager"


BAD = ["flash", "flash_attention_9", "someone/flash-attn3", "kernels-community/", ""]


@pytest.mark.parametrize("value", BAD)
def test_a_bad_value_is_one_line_naming_the_setting(value):
    expected = r"^target\.attn_implementation=.*: expected null, one of eager, sdpa"
    with pytest.raises(UserError, match=expected) as err:
        TargetConfig(attn_implementation=value)
    assert "kernels-community/<kernel>" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["flex_attention", "kernels-community/vllm-flash-attn3@v1:flash_attn_func"])
def test_transformers_names_and_community_kernels_are_taken(value):
    assert TargetConfig(attn_implementation=value).attn_implementation == value


def test_an_attention_transformers_cannot_load_is_one_line(tiny_llama_dir):
    """flash-attn is not installed here (nor is there a GPU): transformers' ImportError becomes
    one line naming the setting."""
    with pytest.raises(UserError, match=r"^target\.attn_implementation=flash_attention_2: ") as err:
        target(tiny_llama_dir, attn_implementation="flash_attention_2").load_model()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["flash_attention_2", "flash_attention_3", "kernels-community/flash-attn3"])
def test_draftsmiths_masked_forwards_refuse_an_attention_that_reads_no_mask(tiny_llama, value):
    """Decoding is refused from the setting before the weights load; capture, from the loaded
    config (here a copy of the tiny target's, set as transformers sets it)."""
    decoders = rf"^target\.attn_implementation={value}: the target gets dense attention masks from draft"
    with pytest.raises(UserError, match=decoders) as err:
        attention_layout(tiny_llama.config, value)
    assert "\n" not in str(err.value) and "optim.val_decode_prompts=0" in str(err.value)
    loaded = tiny_llama.config.__class__.from_dict(tiny_llama.config.to_dict())
    loaded._attn_implementation_internal = value
    with pytest.raises(UserError, match=rf"^target\.attn_implementation={value}: .* from capture, ") as err:
        attention_masks(loaded, causal_mask(4, torch.device("cpu")), torch.arange(4)[None], torch.float32)
    assert "data.capture.backend=vllm" in str(err.value)
    for masked in ("eager", "sdpa", "flex_attention", None):
        assert attention_layout(tiny_llama.config, masked).windows


def test_a_cuda_target_loads_onto_its_gpu(tiny_llama):
    """CUDA cannot exist on this machine: the placement `from_pretrained` gets is checked as
    data. A CUDA target loads with its device as the whole map (not on the CPU, then moved); a
    CPU one as before; `target.device_map` wins."""
    cuda = dataclasses.replace(tiny_llama, device=torch.device("cuda", 1))
    assert cuda._placement() == {"device_map": {"": torch.device("cuda", 1)}}
    assert tiny_llama._placement() == {}
    assert dataclasses.replace(tiny_llama, device_map="auto")._placement() == {"device_map": "auto"}
