"""HF CLIPModel trained with its contrastive loss: two towers (vision, text)."""
import torch
from transformers import CLIPConfig, CLIPModel

SIZES = {
    "tiny": dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  vocab_size=256, max_position_embeddings=16),
                 vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                    image_size=32, patch_size=8), projection_dim=32),
    "full": dict(text_config=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                                  vocab_size=49408, max_position_embeddings=77),
                 vision_config=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                    num_attention_heads=16, image_size=224, patch_size=14), projection_dim=768),
}
SIZE = "tiny"
CONFIG = CLIPConfig(text_config=SIZES[SIZE]["text_config"], vision_config=SIZES[SIZE]["vision_config"],
                    projection_dim=SIZES[SIZE]["projection_dim"])
SEQ_LEN = CONFIG.text_config.max_position_embeddings


def build_model():
    return CLIPModel(CONFIG)


def example_inputs(micro_batch_size):
    v = CONFIG.vision_config
    return {"input_ids": torch.randint(0, CONFIG.text_config.vocab_size, (micro_batch_size, SEQ_LEN)),
            "pixel_values": torch.randn(micro_batch_size, 3, v.image_size, v.image_size), "return_loss": True}


def loss_fn(output, inputs):
    return output.loss
