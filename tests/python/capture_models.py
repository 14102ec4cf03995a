"""Small configurations of real PyTorch models for the torch.export capture tests
(test_capture_models.py): Hugging Face GPT-2, LLaMA, BERT, ViT and T5, torch's
TransformerEncoder, torchvision's ResNet-18 and MobileNetV2. Random weights (no downloads), f32,
dropout 0 (kiln's dropout draws other random numbers than torch's). Each entry is
(make_model(), batch(generator) -> (args, kwargs)); the model returns its loss first."""
import torch

VOCAB, T, B = 96, 16, 2


def _transformers():
    import pytest
    return pytest.importorskip("transformers")


def _ids(g, batch=B, length=T, vocab=VOCAB):
    return torch.randint(0, vocab, (batch, length), generator=g)


def gpt2():
    tf = _transformers()
    cfg = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=T, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)
    model = tf.GPT2LMHeadModel(cfg)

    def batch(g):
        ids = _ids(g)
        labels = ids.clone()
        labels[0, :3] = -100  # ignore_index
        return (), {"input_ids": ids, "labels": labels}
    return model, batch


def llama():
    tf = _transformers()
    cfg = tf.LlamaConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=T, use_cache=False,
                         bos_token_id=0, eos_token_id=0, pad_token_id=None)
    model = tf.LlamaForCausalLM(cfg)

    def batch(g):
        ids = _ids(g)
        return (), {"input_ids": ids, "labels": ids.clone()}
    return model, batch


def bert():
    tf = _transformers()
    cfg = tf.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                        vocab_size=VOCAB, max_position_embeddings=T, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, type_vocab_size=2, pad_token_id=0)
    model = tf.BertForMaskedLM(cfg)

    def batch(g):
        ids = _ids(g)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, T - 5:] = 0  # padding
        labels = torch.full((B, T), -100, dtype=torch.long)
        labels[:, ::3] = ids[:, ::3]
        return (), {"input_ids": ids, "attention_mask": mask, "labels": labels}
    return model, batch


class Encoder(torch.nn.Module):
    """torch's TransformerEncoder over embeddings, a bool key padding mask, a classifier head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = torch.nn.Linear(32, 5)

    def forward(self, ids, padding, labels):
        h = self.encoder(self.embed(ids), src_key_padding_mask=padding)
        return torch.nn.functional.cross_entropy(self.head(h[:, 0]), labels)


def transformer_encoder():
    def batch(g):
        padding = torch.zeros(B, T, dtype=torch.bool)
        padding[1, T - 4:] = True
        return (_ids(g), padding, torch.randint(0, 5, (B,), generator=g)), {}
    return Encoder(), batch


def vit():
    tf = _transformers()
    cfg = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, num_hidden_layers=2, hidden_size=32,
                       intermediate_size=64, num_attention_heads=4, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, num_labels=5)
    model = tf.ViTForImageClassification(cfg)

    def batch(g):
        return (), {"pixel_values": torch.randn(B, 3, 16, 16, generator=g),
                    "labels": torch.randint(0, 5, (B,), generator=g)}
    return model, batch


class Classifier(torch.nn.Module):
    """A torchvision classifier with its cross-entropy loss."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, images, labels):
        return torch.nn.functional.cross_entropy(self.net(images), labels)


def _torchvision():
    import pytest
    return pytest.importorskip("torchvision")


def resnet18():
    tv = _torchvision()
    model = Classifier(tv.models.resnet18(num_classes=5))

    def batch(g):
        return (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)), {}
    return model, batch


def mobilenet_v2():
    tv = _torchvision()
    model = Classifier(tv.models.mobilenet_v2(num_classes=5, width_mult=0.25, dropout=0.0))

    def batch(g):
        return (torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, 5, (4,), generator=g)), {}
    return model, batch


def t5():
    tf = _transformers()
    cfg = tf.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
                      relative_attention_max_distance=16, decoder_start_token_id=0, pad_token_id=0,
                      eos_token_id=1, use_cache=False)
    model = tf.T5ForConditionalGeneration(cfg)

    def batch(g):
        return (), {"input_ids": _ids(g), "labels": _ids(g, length=T // 2)}
    return model, batch


MODELS = {"gpt2": gpt2, "llama": llama, "bert": bert, "transformer_encoder": transformer_encoder, "vit": vit,
          "resnet18": resnet18, "mobilenet_v2": mobilenet_v2, "t5": t5}
