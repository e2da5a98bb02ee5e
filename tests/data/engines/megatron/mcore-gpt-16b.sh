# Megatron-LM README weak-scaling table (Megatron-Core r0.8.0), gpt-16b on 192 H100, as Megatron-LM flags:
# the README states --overlap-grad-reduce --overlap-param-gather --tp-comm-overlap; micro-batch 1, no
# recompute and no interleaving are assumed (it states none), gradients reduced in bf16 as autopar's
# calibration prices these runs.
torchrun --nproc-per-node 8 --nnodes 24 pretrain_gpt.py \
    --num-layers 32 --hidden-size 6144 --num-attention-heads 48 --seq-length 4096 --max-position-embeddings 4096 \
    --vocab-size 131072 --micro-batch-size 1 --global-batch-size 192 \
    --tensor-model-parallel-size 4 --sequence-parallel --tp-comm-overlap --pipeline-model-parallel-size 1 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16 \
    --bf16 --train-iters 100
