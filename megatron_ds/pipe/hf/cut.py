"""A transformers *ForCausalLM cut into a DeepSpeed PipelineModule that megatron_ds.initialize runs under any
of our schedules: [embedding, decoder layer 0 .. n-1, final norm, output layer], each around the model's own
modules, tied embeddings as one TiedLayerSpec at both ends.

The parts are found from the model's own structure, not from a table of families: the base model
(`model.base_model`), its one ModuleList of config.num_hidden_layers decoder layers, its input embedding
(get_input_embeddings), its rotary module or its learned position table (an nn.Embedding beside the token
embedding, GPT-2's wpe, added to it with the base model's embedding dropout: HFPositions), its one remaining
module with parameters (the final norm), and the output layer (get_output_embeddings). What the cut cannot place is refused with one line naming it. Since a
family's forward may compute more than these parts say (a scale, an offset), the cut is checked before it is
handed out: the layers run one after the other must give the model's own logits on a probe of two packed
documents, else it is refused too.
"""
import torch
from deepspeed.pipe import PipelineModule, TiedLayerSpec

from megatron_ds.errors import UserError

from . import attention
from .layers import HFTransformerLayer, HFEmbedding, HFHead, HFNorm, HFPositions, causal_lm_loss, tied_head

# the decoder layers balanced over the stages, embedding first, head last; the shipped ds_configs' "type:transformer"
# (the GPT's layers) matches them too
PARTITION = "type:HFTransformerLayer"


class CutError(UserError):
    pass


def load(source, dtype=torch.float32):
    """A causal LM from `source`: a PreTrainedModel as given, a config (built, weights initialised by
    transformers; seed torch for the same weights on every rank) or a local folder (from_pretrained)."""
    from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
    if isinstance(source, PreTrainedModel):
        return source
    if isinstance(source, PretrainedConfig):
        return AutoModelForCausalLM.from_config(source, dtype=dtype)
    try:
        return AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CutError(f"{source}: not a Hugging Face causal LM folder ({str(exc).splitlines()[0]})") from None


def _causal_lm(name):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    known = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ([v] if isinstance(v, str) else v)}
    return name in known or name.endswith("ForCausalLM")


class Parts:
    """The parts of `model` the pipeline layers are made of."""

    def __init__(self, model):
        name = type(model).__name__
        if not _causal_lm(name) or model.get_output_embeddings() is None:
            raise CutError(f"{name} is not a causal LM (a class of transformers' AutoModelForCausalLM with an output "
                           "layer); only those are cut into pipeline stages")
        self.model, self.config = model, model.config
        self.base = model.base_model
        if self.base is model:
            raise CutError(f"{name} has no base model (base_model_prefix {model.base_model_prefix!r}) holding its "
                           "decoder layers")
        self.embed, self.lm_head = model.get_input_embeddings(), model.get_output_embeddings()
        n = getattr(self.config, "num_hidden_layers", None)
        lists = [(k, m) for k, m in self.base.named_children() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
        if len(lists) != 1:
            raise CutError(f"{name}: found {len(lists)} module lists of config.num_hidden_layers = {n} layers in "
                           f"its base model ({[k for k, _ in lists]}); the cut needs exactly one, the decoder layers")
        self.layers_name, self.layers = lists[0]
        rest = {k: m for k, m in self.base.named_children() if m is not self.embed and k != self.layers_name}
        rotary = [k for k, m in rest.items() if "rotary" in k.lower() or "rotary" in type(m).__name__.lower()]
        if len(rotary) > 1:
            raise CutError(f"{name}: its base model holds {len(rotary)} rotary modules {rotary}; the cut knows one")
        self.rotary = rest.pop(rotary[0]) if rotary else None
        tables = [k for k, m in rest.items() if isinstance(m, torch.nn.Embedding)]
        if len(tables) > 1:
            raise CutError(f"{name}: its base model holds {len(tables)} embeddings besides the token embedding "
                           f"{tables}; the cut knows one, a learned position table")
        self.positions = rest.pop(tables[0]) if tables else None
        drops = [k for k, m in rest.items() if isinstance(m, torch.nn.Dropout)]
        self.dropout = rest.pop(drops[0]) if len(drops) == 1 else None  # the embedding's (GPT-2's drop)
        norms = [k for k, m in rest.items() if any(True for _ in m.parameters())]
        if len(norms) != 1:
            raise CutError(f"{name}: its base model holds {len(norms)} modules with weights besides the embedding "
                           f"and the decoder layers ({norms}); the cut places exactly one there, the final norm")
        self.norm_name, self.norm = norms[0], rest[norms[0]]
        parts = (self.embed, self.layers, self.norm, self.lm_head) + ((self.positions,) if self.positions else ())
        placed = {id(p) for m in parts for p in m.parameters()}
        left = [k for k, p in model.named_parameters() if id(p) not in placed]
        if left:
            raise CutError(f"{name}: parameters outside the embedding, decoder layers, final norm and output layer: "
                           f"{left[:3]}{' ...' if len(left) > 3 else ''}; the cut has no layer for them")
        self.tied = self.lm_head.weight is self.embed.weight
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        if getattr(self.config, "output_router_logits", False):
            raise CutError(f"{name}: config.output_router_logits is set: the router's load-balancing loss is taken "
                           "over every layer's router logits at once, which pipeline stages do not hand on; set it "
                           "to False")

    def layer_types(self):
        types = getattr(self.config, "layer_types", None)
        return list(types) if types is not None else [None] * len(self.layers)

    def layer_list(self):
        """The PipelineModule's layer list."""
        types = self.layer_types()
        decoders = [HFTransformerLayer(layer, self.rotary, types[i]) for i, layer in enumerate(self.layers)]
        if self.tied:
            ends = (TiedLayerSpec("embed", HFEmbedding, self.embed, self.lm_head, self.softcap),
                    TiedLayerSpec("embed", HFEmbedding, self.embed, self.lm_head, self.softcap, forward_fn=tied_head))
        else:
            ends = (HFEmbedding(self.embed), HFHead(self.lm_head, self.softcap))
        extra = [HFPositions(self.positions, self.dropout)] if self.positions or self.dropout else []
        return [ends[0], *extra, *decoders, HFNorm(self.norm), ends[1]]


def sequential(layers):
    """`layers` (a layer list) run one after the other on one process, the tied module built once."""
    tied, calls = {}, []
    for layer in layers:
        if isinstance(layer, TiedLayerSpec):
            module = tied.setdefault(layer.key, layer.build())
            calls.append(module if layer.forward_fn is None else (lambda x, f=layer.forward_fn, m=module: f(m, x)))
        else:
            calls.append(layer)

    def forward(inputs):
        for call in calls:
            inputs = call(inputs)
        return inputs
    return forward


def probe(config):
    """Token ids and position ids of one row holding two documents (positions restart at 0)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (1, 12), generator=g)
    return ids, torch.cat([torch.arange(7), torch.arange(5)]).unsqueeze(0)


def check_cut(model, layers, atol=None):
    """The cut's logits equal the model's own forward's (under the model's own attention, before ours was set)
    on the probe; else the family computes something the cut does not know."""
    ids, positions = probe(model.config)
    device = next(model.parameters()).device
    ids, positions = ids.to(device), positions.to(device)
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            want = model(input_ids=ids, position_ids=positions, use_cache=False).logits.float()
            use_our_attention(model)
            got = sequential(layers)((ids, positions)).float()
    finally:
        model.train(was)
    tol = atol if atol is not None else (1e-4 if model.dtype == torch.float32 else 5e-2)
    diff = (got - want).abs().max().item()
    if not diff <= tol * max(1.0, want.abs().max().item()):
        raise CutError(f"{type(model).__name__}: its layers run one after the other do not give the model's logits "
                       f"(max abs diff {diff:.3g} on a probe of two packed documents): its forward computes "
                       "something between its parts that the cut does not know")


def use_our_attention(model):
    """`model`'s layers run our attention (attention.NAME, registered in transformers' attention interface)."""
    attention.register()
    model.set_attn_implementation(attention.NAME)
    if model.config._attn_implementation != attention.NAME:
        raise CutError(f"{type(model).__name__}: its attention does not go through transformers' AttentionInterface, "
                       "so its layers cannot run megatron_ds's attention")


def pipeline_module(source, num_stages=None, topology=None, partition_method=PARTITION, check=True, **kwargs):
    """A DeepSpeed PipelineModule of `source` (see load()) for megatron_ds.initialize: the decoder layers run our
    attention (registered in transformers' attention interface), the loss is the mean next-token cross entropy
    of labels already shifted. `kwargs` go to PipelineModule (activation_checkpoint_interval, ...). The module's
    `hf_model` is the model whose weights it trains."""
    model = load(source)
    layers = Parts(model).layer_list()
    if check:
        check_cut(model, layers)
    use_our_attention(model)
    # DeepSpeed's activation checkpoints take the decoder layers alone: a reentrant checkpoint of the embedding
    # (integer inputs, no gradient asked) would leave its weights without one
    kwargs.setdefault("checkpointable_layers", ["HFTransformerLayer"])
    return PipelineModule(layers=layers, num_stages=num_stages, topology=topology, loss_fn=causal_lm_loss,
                          partition_method=partition_method, **kwargs)


def hf_names(module, model):
    """{name of a parameter in `module` (a pipeline module over `model`'s layers): the model's own name}."""
    names = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return {name: names[id(p)] for name, p in module.named_parameters()}
