"""The private members of DeepSpeed's ZeRO optimizer this package touches, in one audited place."""


class ZeroInternals:
    """Every private member of DeepSpeed's DeepSpeedZeroOptimizer (runtime/zero/stage_1_and_2.py)
    that this package uses (post-validation's step, the optimizer state re-cut by name, a fresh
    optimizer after a universal load), read from DeepSpeed DEEPSPEED_VERSION: the one place to audit
    when DeepSpeed moves. The public state (averaged_gradients, single_partition_of_fp32_groups,
    bit16_groups, param_names, loss_scaler, ...) is read directly."""

    DEEPSPEED_VERSION = "0.19.8"
    METHODS = ("_update_scale", "_optimizer_step", "_get_preflattened_grad_partition",
               "_release_preflattened_grad_buffers", "_commit_muon_momentum", "_update_model_bit16_weights",
               "_load_global_state")
    ATTRIBUTES = ("_global_grad_norm", "_hp_optimizer_states_linked")
    PARAM_ATTRIBUTES = ("_hp_mapping",)  # set on each bit16 parameter by DeepSpeed's hp-param linking
    TENSOR_ATTRIBUTES = ("_zero_padding",)  # set on the padding gradients of a partition

    def __init__(self, opt):
        self.opt = opt

    def update_scale(self, overflow: bool):
        """The dynamic loss scaler's update (fp16), in DeepSpeed's place in the step."""
        self.opt._update_scale(overflow)

    def optimizer_step(self, group: int):
        self.opt._optimizer_step(group)

    def preflattened_grad_partition(self, group: int):
        return self.opt._get_preflattened_grad_partition(group)

    def release_preflattened_grad_buffers(self, group: int | None = None):
        if group is None:
            self.opt._release_preflattened_grad_buffers()
        else:
            self.opt._release_preflattened_grad_buffers(group)

    def commit_muon_momentum(self):
        self.opt._commit_muon_momentum()

    def update_model_bit16_weights(self, group: int):
        self.opt._update_model_bit16_weights(group)

    def set_global_grad_norm(self, norm):
        """What engine.get_global_grad_norm() reports."""
        self.opt._global_grad_norm = norm

    def load_global_state(self, state_dict):
        """The loss scaler and clipping settings of a saved shard (the same on every shard)."""
        self.opt._load_global_state(state_dict)

    @staticmethod
    def is_padding(grad) -> bool:
        """Whether `grad` is padding ZeRO added to a partition (no parameter's gradient)."""
        return getattr(grad, "_zero_padding", False)

    @staticmethod
    def hp_mapping(param):
        """Where this data-parallel rank's fp32 partition holds a slice of `param`; None: it holds none."""
        return param._hp_mapping

    def relink_hp_optimizer_states(self):
        """Make the next _optimizer_step link DeepSpeed's hp mappings to new state tensors."""
        self.opt._hp_optimizer_states_linked = False
