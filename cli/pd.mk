# pdtool's Make face. In an experiment's Makefile:
#
#     include path/to/pdtool/cli/pd.mk
#     PD_MODEL_resnet = pdtool.zoo:resnet50          # model spec for resnet.profile.json
#     PD_ARGS_resnet  = -a width=16 -b 8             # its extra `pd profile` flags
#     all: resnet.profile.json
#
# For a target NAME.profile.json the model is $(PD_MODEL_NAME), or pdtool.zoo:NAME when unset;
# PD_PROFILE_FLAGS applies to every profile. Outputs are written atomically, so an interrupted
# or failed command never leaves a half file that Make would take as up to date.

PD ?= pd
PD_PROFILE_FLAGS ?=

pd_name = $(notdir $*)

%.profile.json:
	$(PD) profile --model $(or $(PD_MODEL_$(pd_name)),pdtool.zoo:$(pd_name)) $(PD_ARGS_$(pd_name)) $(PD_PROFILE_FLAGS) -o $@

# `make NAME.profile.show` prints the summary table of NAME.profile.json.
%.profile.show: %.profile.json
	$(PD) show $<
