# NVIDIA dgxc-benchmarking GPT-3 175B, 128 H100 (release v25.02, gpt3_175b_hydra.yaml) as Megatron-LM flags.
# NeMo's performance recipe: TP comm overlap, distributed optimizer with overlapped grad/param sync,
# gradients reduced in bf16 (recipe.trainer.plugins.grad_reduce_in_fp32 = False).
torchrun --nproc-per-node 8 --nnodes 16 pretrain_gpt.py \
    --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --ffn-hidden-size 49152 \
    --seq-length 2048 --max-position-embeddings 2048 --vocab-size 51200 \
    --micro-batch-size 1 --global-batch-size 256 \
    --tensor-model-parallel-size 4 --sequence-parallel --tp-comm-overlap \
    --pipeline-model-parallel-size 8 --num-layers-per-virtual-pipeline-stage 2 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16 \
    --bf16 --optimizer adam --lr 0.9e-4 --min-lr 0.9e-5 --lr-decay-style cosine --weight-decay 0.1 \
    --clip-grad 1.0 --train-iters 50 --log-interval 1 --transformer-impl transformer_engine
