# Training image: bertforge + Ray + DeepSpeed + the CUDA build of torch, for Ray cluster nodes
# (`docker:` in infra/ray/*.yaml) and KubeRay pods (infra/kubernetes/*.yaml). Build from the
# repository root (BuildKit reads train.Dockerfile.dockerignore beside this file):
#
#   docker build -f infra/docker/train.Dockerfile -t REGION-docker.pkg.dev/PROJECT/bertforge/train:0.1.0 .
#
# No credentials are baked in: nodes get cloud access from their service account / instance
# profile at run time, never from this image.
#
# No ENTRYPOINT on purpose: the Ray cluster launcher starts the container with `bash` and KubeRay
# overrides the command with `ray start ...`; both would be broken by one.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04

ARG PYTHON=python3.11
# The CUDA build of torch (the wheel carries its CUDA libraries; the base image gives the driver
# mounts and cuDNN). Match the index to the CUDA version above.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
# The versions tested; RAY_VERSION is the KubeRay manifests' rayVersion (keep them equal: every
# node of a cluster, the client that submits to it too, runs one Ray).
ARG RAY_VERSION=2.60.0
ARG DEEPSPEED_VERSION=0.19.8
# The autoscaler runs inside the head container and needs the cloud SDKs (GCP and AWS launchers).
ARG CLOUD_SDKS="google-api-python-client boto3"

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# rsync and openssh-client: the Ray cluster launcher syncs files into the container with
# `rsync -e 'docker exec'` and the head's autoscaler reaches worker VMs over ssh.
# wget: KubeRay's default readiness/liveness probes call it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends software-properties-common gpg-agent \
    && add-apt-repository -y ppa:deadsnakes/ppa \
    && apt-get update \
    && apt-get install -y --no-install-recommends \
       ${PYTHON} ${PYTHON}-venv ${PYTHON}-dev build-essential \
       rsync openssh-client wget ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN ${PYTHON} -m venv ${VIRTUAL_ENV} && pip install --upgrade pip setuptools wheel ninja

# torch first, from the CUDA index: an unpinned resolution later could pick another build.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"
# DeepSpeed's setup.py imports torch: build without isolation against the torch above (an
# isolated build would download a second torch). DS_BUILD_OPS=0: the loop uses torch's AdamW, so
# no DeepSpeed CUDA op is needed; any that is compiles just in time (then use a -devel base).
RUN DS_BUILD_OPS=0 pip install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}"

# Installed as the package `bertforge` (bertforge.pipelines, .training, .cluster); the sources
# are removed, so nothing but site-packages provides it (`bertforge submit --working-dir` ships
# a checkout's code as runtime_env py_modules, which take precedence over it).
# The context is the package's sources (train.Dockerfile.dockerignore admits nothing else).
WORKDIR /tmp/bertforge
COPY . ./
RUN pip install . "ray[train,default]==${RAY_VERSION}" ${CLOUD_SDKS} \
    && cd / && rm -rf /tmp/bertforge \
    && python -c "import torch, deepspeed, ray.train, bertforge.cluster.cli; print('torch', torch.__version__)" \
    && bertforge --help > /dev/null
WORKDIR /

# A non-root user (uid 1000, the same as Ray's own images and KubeRay's examples); the venv
# stays root-owned, so the code in the image cannot be changed at run time.
RUN useradd --create-home --uid 1000 --shell /bin/bash ray \
    && mkdir -p /shared && chown ray:ray /shared
USER ray
ENV HOME=/home/ray
WORKDIR /home/ray
CMD ["bash"]
