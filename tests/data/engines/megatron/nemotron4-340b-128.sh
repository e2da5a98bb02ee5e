# NVIDIA dgxc-benchmarking Nemotron-4 340B, 128 H100 (release v24.11.1, nemotron4-340b-synth.yaml) as
# Megatron-LM flags: no TP comm overlap in this run, selective recompute, Adam moments in bf16. NeMo's
# distributed_fused_adam with bf16 states keeps no fp32 master copy, which no Megatron-LM flag says:
# here the precision-aware optimizer keeps its default fp32 master copy.
torchrun --nproc-per-node 8 --nnodes 16 pretrain_gpt.py \
    --num-layers 96 --hidden-size 18432 --num-attention-heads 96 --group-query-attention --num-query-groups 8 \
    --ffn-hidden-size 73728 --squared-relu --position-embedding-type rope --normalization LayerNorm \
    --seq-length 4096 --max-position-embeddings 4096 --vocab-size 256000 \
    --micro-batch-size 1 --global-batch-size 32 \
    --tensor-model-parallel-size 8 --sequence-parallel \
    --pipeline-model-parallel-size 8 --num-virtual-stages-per-pipeline-rank 12 \
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16 \
    --use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16 \
    --recompute-activations --bf16 --train-iters 50
