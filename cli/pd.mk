# pdtool's Make face. In an experiment's Makefile:
#
#     include path/to/pdtool/cli/pd.mk
#     PD_MODEL_resnet = pdtool.zoo:resnet50          # model spec for resnet.profile.json
#     PD_ARGS_resnet  = -a width=16 -b 8             # its extra `pd profile` flags
#     PD_CLUSTER      = 4x12GB/s,4x10Gbit/s          # cluster every plan is made for
#     all: resnet.svg resnet.trace.json
#
# Targets, for a NAME:
#   NAME.profile.json  pd profile: model $(PD_MODEL_NAME), or pdtool.zoo:NAME when unset;
#                      flags $(PD_ARGS_NAME) and $(PD_PROFILE_FLAGS)
#   NAME.plan.json     pd plan of NAME.profile.json for $(PD_CLUSTER_NAME) or $(PD_CLUSTER),
#                      flags $(PD_PLAN_ARGS_NAME) and $(PD_PLAN_FLAGS); re-made only when the profile changed
#   NAME.svg/.png/.pdf the plan drawn: its stages and their blocks (pd show --render)
#   NAME.trace.json    the simulated schedule as a Chrome trace (pd simulate --trace)
#   NAME.metrics.csv   a training run: pd train of NAME.plan.json with flags $(PD_TRAIN_ARGS_NAME) and
#                      $(PD_TRAIN_FLAGS) (e.g. --data digits --epochs 10 --evaluate); the CSV has a row
#                      per step; re-run only when the plan changed
#   NAME.profile.show / NAME.plan.show   print the summary tables
# Outputs are written atomically, so an interrupted or failed command never leaves a half
# file that Make would take as up to date.

PD ?= pd
PD_PROFILE_FLAGS ?=
PD_CLUSTER ?= 4x12GB/s
PD_PLAN_FLAGS ?=
PD_SIMULATE_FLAGS ?=
PD_TRAIN_FLAGS ?=

pd_name = $(notdir $*)

# Profiles and plans made on the way to a picture or a trace are results, not scratch files:
# keep them (GNU make would delete intermediates of a pattern chain).
.PRECIOUS: %.profile.json %.plan.json

%.profile.json:
	$(PD) profile --model $(or $(PD_MODEL_$(pd_name)),pdtool.zoo:$(pd_name)) $(PD_ARGS_$(pd_name)) $(PD_PROFILE_FLAGS) -o $@

%.plan.json: %.profile.json
	$(PD) plan $< --cluster $(or $(PD_CLUSTER_$(pd_name)),$(PD_CLUSTER)) $(PD_PLAN_ARGS_$(pd_name)) $(PD_PLAN_FLAGS) -o $@

%.svg: %.plan.json %.profile.json
	$(PD) show $< --profile $(word 2,$^) --render $@ >/dev/null

%.png: %.plan.json %.profile.json
	$(PD) show $< --profile $(word 2,$^) --render $@ >/dev/null

%.pdf: %.plan.json %.profile.json
	$(PD) show $< --profile $(word 2,$^) --render $@ >/dev/null

%.trace.json: %.plan.json
	$(PD) simulate $< $(PD_SIMULATE_FLAGS) --trace $@

%.metrics.csv: %.plan.json
	$(PD) train $< $(PD_TRAIN_ARGS_$(pd_name)) $(PD_TRAIN_FLAGS) --metrics $@

%.profile.show: %.profile.json
	$(PD) show $<

%.plan.show: %.plan.json
	$(PD) show $<
