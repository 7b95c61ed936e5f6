{{/*
Resource name prefix: the release name (or fullnameOverride). At most 40 characters so that
"<prefix>-worker-<ordinal>" and the StatefulSet's controller-revision-hash label fit in 63.
*/}}
{{- define "podrl.fullname" -}}
{{- $name := default .Release.Name .Values.fullnameOverride -}}
{{- if gt (len $name) 40 -}}
{{- fail (printf "release name %q is %d characters long; podrl needs at most 40 (names such as %s-worker-0 must stay valid): choose a shorter release name or set fullnameOverride" $name (len $name) $name) -}}
{{- end -}}
{{- $name -}}
{{- end -}}

{{- define "podrl.controllerName" -}}{{ include "podrl.fullname" . }}-controller{{- end -}}
{{- define "podrl.workerName" -}}{{ include "podrl.fullname" . }}-worker{{- end -}}
{{- define "podrl.configName" -}}{{ include "podrl.fullname" . }}-config{{- end -}}
{{- define "podrl.gpuClaimTemplateName" -}}{{ include "podrl.fullname" . }}-worker-gpus{{- end -}}

{{/* The controller's run-state claim (the workers' claims come from volumeClaimTemplates). */}}
{{- define "podrl.controllerStateClaimName" -}}
{{- default (printf "%s-controller-state" (include "podrl.fullname" .)) .Values.persistence.controller.existingClaim -}}
{{- end -}}

{{/* The Secret holding the run's shared secret: auth.existingSecret or the chart's own. */}}
{{- define "podrl.runSecretName" -}}
{{- default (printf "%s-run-secret" (include "podrl.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Where every service container finds the run's shared secret. */}}
{{- define "podrl.runSecretDir" -}}/var/run/secrets/podrl{{- end -}}
{{- define "podrl.runSecretFile" -}}{{ include "podrl.runSecretDir" . }}/run-secret{{- end -}}

{{/* The pod's weights key (podrl.weights.protocol): a memory-backed emptyDir that only the
trainer and the generator mount; the trainer creates the key there at its first start, the
generator reads it. It lives as long as the pod, so a restarted container keeps it. */}}
{{- define "podrl.weightsKeyDir" -}}/var/run/podrl/weights-key{{- end -}}
{{- define "podrl.weightsKeyFile" -}}{{ include "podrl.weightsKeyDir" . }}/key{{- end -}}

{{/* The model folder the trainer and the generator load (model.mountPath + model.folder). */}}
{{- define "podrl.modelPath" -}}
{{- $mount := trimSuffix "/" .Values.model.mountPath -}}
{{- if .Values.model.folder -}}
{{- printf "%s/%s" $mount (trimAll "/" .Values.model.folder) -}}
{{- else -}}
{{- $mount -}}
{{- end -}}
{{- end -}}

{{/* values.runConfig with the model folder set for the trainer and the generator. */}}
{{- define "podrl.runConfig" -}}
{{- $run := deepCopy .Values.runConfig -}}
{{- range $service := list "trainer" "generator" -}}
{{- $section := get $run $service | default dict -}}
{{- $_ := set $section "model_path" (include "podrl.modelPath" $) -}}
{{- $_ := set $run $service $section -}}
{{- end -}}
{{- toYaml $run -}}
{{- end -}}

{{- define "podrl.controllerServiceAccountName" -}}
{{- default (include "podrl.controllerName" .) .Values.controller.serviceAccount.name -}}
{{- end -}}

{{/* In-cluster DNS name of the controller Service (workers register there). */}}
{{- define "podrl.controllerHost" -}}
{{- printf "%s.%s.svc" (include "podrl.controllerName" .) .Release.Namespace -}}
{{- end -}}

{{/* Standard labels (app.kubernetes.io/*) of every object; pass (dict "root" $ "component" "x"). */}}
{{- define "podrl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "podrl.podLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
{{- end -}}

{{/* Labels of pod templates and claim templates: no chart or app version, so that a chart
bump alone restarts no pod (a changed run config still does, through checksum/config). */}}
{{- define "podrl.podLabels" -}}
{{ include "podrl.selectorLabels" . }}
app.kubernetes.io/part-of: podrl
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/* The immutable subset used in selectors. */}}
{{- define "podrl.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image reference of a service; pass (dict "root" $ "service" "generator"), optionally
"variant" (cpu or cuda) instead of images.variant. */}}
{{- define "podrl.image" -}}
{{- $images := .root.Values.images -}}
{{- $tag := default .root.Chart.AppVersion $images.tag -}}
{{- $variant := default $images.variant .variant -}}
{{- if and (eq $variant "cpu") (has .service (list "generator" "trainer")) -}}
{{- $tag = printf "%s-cpu" $tag -}}
{{- end -}}
{{- printf "%s/%s:%s" $images.registry (get $images.names .service) $tag -}}
{{- end -}}

{{/* gRPC port of a service from runConfig, falling back to podrl's defaults. */}}
{{- define "podrl.grpcPort" -}}
{{- $defaults := dict "controller" 50050 "generator" 50051 "grader" 50052 "trainer" 50053 "environments" 50054 -}}
{{- $section := get .root.Values.runConfig .service | default dict -}}
{{- get $section "grpc_port" | default (get $defaults .service) | int -}}
{{- end -}}

{{/* The worker pod's services as a JSON list: trainer, generator and grader, and the
environment service when a task of runConfig names an environment (the controller plays its
episodes on it at environments.grpc_port on the generator's host, docs/environments.md). */}}
{{- define "podrl.workerServices" -}}
{{- $services := list "trainer" "generator" "grader" -}}
{{- $episodes := false -}}
{{- range (dig "tasks" "definitions" list .Values.runConfig) -}}
{{- if .environment -}}{{- $episodes = true -}}{{- end -}}
{{- end -}}
{{- if $episodes -}}{{- $services = append $services "environments" -}}{{- end -}}
{{- toJson $services -}}
{{- end -}}

{{/* Prometheus port of a worker service from runConfig (0 = off). */}}
{{- define "podrl.metricsPort" -}}
{{- $defaults := dict "generator" 9101 "grader" 9102 "trainer" 9103 "environments" 9104 -}}
{{- $section := get .root.Values.runConfig .service | default dict -}}
{{- if hasKey $section "metrics_port" -}}
{{- get $section "metrics_port" | int -}}
{{- else -}}
{{- get $defaults .service -}}
{{- end -}}
{{- end -}}

{{/* The torchft Lighthouse that forms each step's quorum of the worker pods' trainers
(docs/scaling.md): a sidecar container of the controller pod whenever more than one worker pod
may run (runConfig.controller.max_worker_pods > 1; podrl's default is 8), as `podrl up` starts
one then. "true" or "". */}}
{{- define "podrl.lighthouseEnabled" -}}
{{- if gt (int (dig "controller" "max_worker_pods" 8 .Values.runConfig)) 1 -}}true{{- end -}}
{{- end -}}

{{/* The Lighthouse's port: the port of runConfig.trainer.replication.lighthouse_bind
(podrl's default [::]:29510). It must be fixed: the controller Service exposes it. */}}
{{- define "podrl.lighthousePort" -}}
{{- $bind := toString (dig "trainer" "replication" "lighthouse_bind" "[::]:29510" .Values.runConfig) -}}
{{- $port := regexFind ":[0-9]+$" $bind | trimPrefix ":" -}}
{{- if or (not $port) (lt (int $port) 1) (gt (int $port) 65535) -}}
{{- fail (printf "runConfig.trainer.replication.lighthouse_bind=%s: the chart needs host:port with a fixed port from 1 to 65535 (the controller Service exposes it to the worker pods), e.g. \"[::]:29510\"" $bind) -}}
{{- end -}}
{{- int $port -}}
{{- end -}}

{{/* Where the worker pods' trainers reach the Lighthouse: the controller Service. */}}
{{- define "podrl.lighthouseAddress" -}}
{{- printf "%s:%d" (include "podrl.controllerHost" .) (include "podrl.lighthousePort" . | int) -}}
{{- end -}}

{{- define "podrl.httpPort" -}}
{{- $section := .Values.runConfig.controller | default dict -}}
{{- get $section "http_port" | default 8080 | int -}}
{{- end -}}

{{/* Container security context: non-root, read-only root, no capabilities, RuntimeDefault. */}}
{{- define "podrl.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Environment shared by every podrl container. HOME and caches go to the /tmp emptyDir. */}}
{{- define "podrl.commonEnv" -}}
- name: PODRL_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: PODRL_CONTROLLER__ADVERTISE_HOST
  value: {{ include "podrl.controllerHost" . | quote }}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: PYTHONUNBUFFERED
  value: "1"
- name: PODRL_RUN_SECRET_FILE
  value: {{ include "podrl.runSecretFile" . | quote }}
# No usage reports to vLLM or other tools' telemetry (air-gapped clusters; also set in images).
- name: VLLM_NO_USAGE_STATS
  value: "1"
- name: DO_NOT_TRACK
  value: "1"
{{- end -}}

{{/* The run secret's volume (pod spec) and mount (container); see podrl.runSecretName. */}}
{{- define "podrl.runSecretVolume" -}}
- name: run-secret
  secret:
    secretName: {{ include "podrl.runSecretName" . }}
    items:
      - key: {{ .Values.auth.secretKey }}
        path: run-secret
    # Owner and fsGroup may read it; nobody else.
    defaultMode: 0440
{{- end -}}
{{- define "podrl.runSecretMount" -}}
- name: run-secret
  mountPath: {{ include "podrl.runSecretDir" . }}
  readOnly: true
{{- end -}}

{{/* Does gpu.count fit what the pod runs on its GPUs? The trainer runs dp_shard × tp ranks,
one GPU each, and the generator tensor_parallel_size GPUs, on the same devices. Fails with the
fields to change. In DRA mode, GPUs nobody uses are refused too (the claim would hold them). */}}
{{- define "podrl.checkGpuCount" -}}
{{- if ne .Values.gpu.mode "none" -}}
{{- $run := .Values.runConfig -}}
{{- $count := int .Values.gpu.count -}}
{{- $dp := int (dig "trainer" "dp_shard" 1 $run) -}}
{{- $tp := int (dig "trainer" "tp" 1 $run) -}}
{{- $ranks := mul $dp $tp -}}
{{- $generatorTp := int (dig "generator" "tensor_parallel_size" 1 $run) -}}
{{- if lt $count $ranks -}}
{{- fail (printf "gpu.count=%d is too small: the trainer runs runConfig.trainer.dp_shard x runConfig.trainer.tp = %d x %d = %d ranks, one GPU each; set gpu.count to at least %d or lower dp_shard/tp" $count $dp $tp $ranks $ranks) -}}
{{- end -}}
{{- if lt $count $generatorTp -}}
{{- fail (printf "gpu.count=%d is too small: runConfig.generator.tensor_parallel_size=%d needs %d GPUs; set gpu.count to at least %d or lower tensor_parallel_size" $count $generatorTp $generatorTp $generatorTp) -}}
{{- end -}}
{{- $used := max $ranks $generatorTp -}}
{{- if and (eq .Values.gpu.mode "dra") (gt $count $used) -}}
{{- fail (printf "gpu.count=%d but the pod uses %d GPUs (runConfig.trainer.dp_shard x runConfig.trainer.tp = %d, runConfig.generator.tensor_parallel_size = %d); the claim would hold %d GPUs nobody uses: set gpu.count=%d or raise those fields" $count $used $ranks $generatorTp (sub $count $used) $used) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Combinations of values the schema cannot express; each failure names the fields. */}}
{{- define "podrl.checkValues" -}}
{{- include "podrl.checkGpuCount" . -}}
{{- $stateMount := trimSuffix "/" .Values.persistence.mountPath -}}
{{- $runDir := toString .Values.runConfig.run_dir -}}
{{- if not (hasPrefix (printf "%s/" $stateMount) $runDir) -}}
{{- fail (printf "runConfig.run_dir=%s is not below persistence.mountPath=%s: the controller and the trainer would write on their read-only root filesystems; set run_dir to a folder below %s" $runDir $stateMount $stateMount) -}}
{{- end -}}
{{- $modelMount := trimSuffix "/" .Values.model.mountPath -}}
{{- range $taken := list "/etc/podrl" "/tmp" "/dev/shm" (include "podrl.runSecretDir" .) $stateMount -}}
{{- if or (eq $modelMount $taken) (hasPrefix (printf "%s/" $modelMount) $taken) (hasPrefix (printf "%s/" $taken) $modelMount) -}}
{{- fail (printf "model.mountPath=%s overlaps %s, which the worker containers already mount: choose another model.mountPath (default /models)" $modelMount $taken) -}}
{{- end -}}
{{- end -}}
{{- $maxPods := int (dig "controller" "max_worker_pods" 8 .Values.runConfig) -}}
{{- if gt (int .Values.workers.replicas) $maxPods -}}
{{- fail (printf "workers.replicas=%d is above runConfig.controller.max_worker_pods=%d: the controller trains at most that many pods (and refuses a larger scale); lower workers.replicas or raise max_worker_pods" (int .Values.workers.replicas) $maxPods) -}}
{{- end -}}
{{- if dig "trainer" "replication" "lighthouse_address" "" .Values.runConfig -}}
{{- fail "runConfig.trainer.replication.lighthouse_address is set by the chart (the torchft Lighthouse beside the controller, through the controller Service); remove it from runConfig" -}}
{{- end -}}
{{- if include "podrl.lighthouseEnabled" . -}}
{{- $_ := include "podrl.lighthousePort" . -}}
{{- end -}}
{{- if and .Values.monitoring.serviceMonitor.enabled .Values.monitoring.podMonitor.enabled -}}
{{- fail "monitoring.serviceMonitor.enabled and monitoring.podMonitor.enabled are both true: Prometheus would scrape every target twice; enable one of them" -}}
{{- end -}}
{{- end -}}

{{/* Is DRA mode usable on the target cluster? Fails with the fix when it is not. */}}
{{- define "podrl.checkGpuMode" -}}
{{- if eq .Values.gpu.mode "dra" -}}
{{- if not (semverCompare ">=1.34.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "gpu.mode=dra needs Kubernetes >= 1.34 (resource.k8s.io/v1 ResourceClaims); this cluster is %s: set gpu.mode=devicePlugin" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- end -}}
