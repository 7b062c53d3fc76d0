#!/usr/bin/env bash
# Build the worker/launcher image, publish the Flex Template spec, and (optionally) run it.
#   PROJECT=my-project REGION=us-central1 BUCKET=my-bucket infra/dataflow/flex-template.sh build
#   PROJECT=... REGION=... BUCKET=... infra/dataflow/flex-template.sh run 'gs://B/wiki/*.xml.bz2'
# Needs gcloud (authenticated) and docker; run from the repository root.
set -euo pipefail
: "${PROJECT:?}" "${REGION:?}" "${BUCKET:?}"
IMAGE="${IMAGE:-${REGION}-docker.pkg.dev/${PROJECT}/bertforge/worker:0.1.0}"
SPEC="gs://${BUCKET}/templates/bertforge-prepare.json"
case "${1:-build}" in
  build)
    docker build -f infra/dataflow/Dockerfile -t "${IMAGE}" .
    docker push "${IMAGE}"
    gcloud dataflow flex-template build "${SPEC}" --image "${IMAGE}" --sdk-language PYTHON \
      --metadata-file infra/dataflow/metadata.json
    ;;
  run)
    gcloud dataflow flex-template run "bertforge-prepare-$(date +%Y%m%d-%H%M%S)" \
      --template-file-gcs-location "${SPEC}" --region "${REGION}" \
      --parameters input="${2:?input pattern}",output="gs://${BUCKET}/shards",vocab="gs://${BUCKET}/vocab/vocab.txt" \
      --parameters sdk_container_image="${IMAGE}",temp_location="gs://${BUCKET}/tmp" \
      --parameters num_shards=256
    ;;
  *) echo "usage: $0 build|run INPUT" >&2; exit 2 ;;
esac
