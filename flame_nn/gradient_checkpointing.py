"""Model-level gradient checkpointing switches, with diffusers' / transformers' names, for a model whose blocks each
carry the `gradient_checkpointing` / `checkpoint_offload` flags that `flame_core.checkpoint.maybe_checkpoint` reads."""


class GradientCheckpointingMixin:
    """Mix into a Module whose `checkpointed_blocks()` lists the blocks gradient checkpointing recomputes:

        class Flux(GradientCheckpointingMixin, flame_nn.Module):
            def checkpointed_blocks(self):
                return [*self.double_blocks, *self.single_blocks]

    gives `enable_gradient_checkpointing(enabled=True, offload=False)`, `disable_gradient_checkpointing()` and the
    `gradient_checkpointing` property (setting it switches every block; it reads True when every block is on)."""

    def checkpointed_blocks(self):
        raise NotImplementedError(f"{type(self).__name__} must list the blocks gradient checkpointing recomputes "
                                  f"(checkpointed_blocks)")

    def enable_gradient_checkpointing(self, enabled=True, offload=False, save=()):
        """Recompute each block in backward instead of keeping its activations (`offload`: keep the block inputs in
        pinned host memory until then; `save`: op kinds whose outputs each block keeps instead of recomputing them,
        flame_core.checkpoint.SAVE_KINDS -- "attention": the recompute skips the attention kernels, at the cost of
        one attention output per block). Returns the model."""
        from flame_core.checkpoint import save_kinds
        save = save_kinds(save)
        if save and not enabled:
            raise ValueError(f"enable_gradient_checkpointing: save={save} is what checkpointed blocks keep; it needs "
                             f"enabled=True")
        for block in self.checkpointed_blocks():
            block.gradient_checkpointing = enabled
            block.checkpoint_offload = offload
            block.checkpoint_save = save
        return self

    def disable_gradient_checkpointing(self):
        return self.enable_gradient_checkpointing(False)

    @property
    def gradient_checkpointing(self):
        return all(block.gradient_checkpointing for block in self.checkpointed_blocks())

    @gradient_checkpointing.setter
    def gradient_checkpointing(self, enabled):
        self.enable_gradient_checkpointing(bool(enabled))
