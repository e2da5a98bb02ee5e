# NVIDIA dgxc-benchmarking Nemotron-4 15B, 16 H100, tp 4 (release v24.11.1) as Megatron-LM flags.
torchrun --nproc-per-node 8 --nnodes 2 pretrain_gpt.py \
    --num-layers 32 --hidden-size 6144 --num-attention-heads 48 --group-query-attention --num-query-groups 8 \
    --ffn-hidden-size 24576 --squared-relu --position-embedding-type rope --normalization LayerNorm \
    --seq-length 4096 --max-position-embeddings 4096 --vocab-size 256000 \
    --micro-batch-size 4 --global-batch-size 64 \
    --tensor-model-parallel-size 4 --sequence-parallel --tp-comm-overlap \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16 \
    --bf16 --train-iters 50
