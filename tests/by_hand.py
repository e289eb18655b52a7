"""A proposer spec driven by hand, outside the loop: the protocol's calls (speculate/proposers/
protocol.py) with their context objects built from plain arguments, for tests that feed a spec
chosen prompts, tokens and verdicts and compare what it drafts with a reference."""

import jax
import jax.numpy as jnp

from specjax.speculate.proposers import InitContext, ProposeContext, UpdateContext


def init(spec, target_params, params, prompt_tokens, prompt_lengths, capacity, features, target_cache=None):
    """`spec.init` after a prefill of prompt_tokens [B, T] whose features [B, T, F] are given."""
    context = InitContext(
        target_params, params, prompt_tokens, prompt_lengths, capacity, features, target_cache
    )
    return spec.init(context)


def propose_fn(spec, jit=True):
    """propose(target_params, params, state, tokens, lengths, keys, sampling, history, width=None)
    -> (Proposal, state), jitted unless `jit` is False."""

    def propose(target_params, params, state, tokens, lengths, keys, sampling, history, width=None):
        context = ProposeContext(target_params, params, tokens, lengths, keys, sampling, history, width)
        return spec.propose(context, state)

    return jax.jit(propose, static_argnames="width") if jit else propose


def observe_fn(spec, jit=True):
    """observe(target_params, params, state, tokens, lengths) -> state, jitted unless `jit` is False."""

    def observe(target_params, params, state, tokens, lengths):
        return spec.observe(ProposeContext(target_params, params, tokens, lengths, None, None, None), state)

    return jax.jit(observe) if jit else observe


def propose(spec, target_params, params, state, tokens, lengths, keys, sampling, history):
    return propose_fn(spec, jit=False)(target_params, params, state, tokens, lengths, keys, sampling, history)


def observe(spec, target_params, params, state, tokens, lengths):
    return observe_fn(spec, jit=False)(target_params, params, state, tokens, lengths)


def update(spec, state, path_features, num_accepted, running=None):
    """`spec.update` after a verdict: every row running unless `running` says otherwise."""
    num_accepted = jnp.asarray(num_accepted, jnp.int32)
    if running is None:
        running = jnp.ones(num_accepted.shape, bool)
    return spec.update(UpdateContext(path_features, num_accepted, running), state)
