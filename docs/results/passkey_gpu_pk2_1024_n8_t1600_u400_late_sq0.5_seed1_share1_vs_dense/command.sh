set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
ls /tmp/site >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
A="--config.optim.learning_rate=5e-4 --config.data.single_question_fraction=0.5 --config.train.seed=1 --config.data.seed=1"
S="--config.train.num_steps=400 --config.train.eval_every=200 --config.checkpoint.every_steps=200"
N=/tmp/h200/pk2_1024_n8_t1600_seed1_share1; D=/tmp/h200/pk2_1024_n8_t1600_seed1
ls -d $N/nsa $D/dense || exit 3
T="timeout -k 60 -s TERM 240 python3 -m experiments.train --config=configs/sweep_needle.py:gpu"
$T $S $A --config.model.selection_from_layer=1 --workdir=$N/nsa_s3 --config.checkpoint.init_from=$N/nsa > $OUT/share1_nsa_s3.log 2>&1; grep "^done:" $OUT/share1_nsa_s3.log
$T $S $A --config.model.attention=dense --workdir=$D/dense_s3 --config.checkpoint.init_from=$D/dense > $OUT/seed1_dense_s3.log 2>&1; grep "^done:" $OUT/seed1_dense_s3.log
for w in $N/nsa_s3:share1_nsa_s3 $D/dense_s3:seed1_dense_s3; do mkdir -p $OUT/${w#*:}; cp ${w%%:*}/{metrics.jsonl,config.json,loss.png} $OUT/${w#*:}/; done
python3 -m experiments.needle_eval --mode=needle --workdirs=$N/nsa_s3,$D/dense_s3 --labels=nsa_share1_s3,dense_s3 --lengths=2048,4096,8192 --depths=0,0.05,0.25,0.5,0.75,1 --samples=16 --out=$OUT/needle_gpu_pk2_1024_n8_t1600_u400_late_sq0.5_seed1_share1_vs_dense.png > $OUT/needle_s3.log 2>&1; tail -n 20 $OUT/needle_s3.log
timeout -k 10 150 python3 -m experiments.needle_eval --mode=blocks --workdirs=$N/nsa_s3 --labels=nsa_share1_s3 --lengths=2048,4096 --depths=0,0.05,0.25,0.5,0.75,1 --samples=16 --out=$OUT/needle_blocks_gpu_pk2_1024_n8_t1600_u400_late_sq0.5_seed1_share1_nsa_s3.json > $OUT/needle_blocks_s3.log 2>&1; grep "digits only a chosen" $OUT/needle_blocks_s3.log
