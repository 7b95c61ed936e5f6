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

{{- define "podrl.runStateClaimName" -}}
{{- default (printf "%s-run-state" (include "podrl.fullname" .)) .Values.persistence.existingClaim -}}
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
{{ include "podrl.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/part-of: podrl
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}

{{/* The immutable subset used in selectors. */}}
{{- define "podrl.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image reference of a service; pass (dict "root" $ "service" "generator"). */}}
{{- define "podrl.image" -}}
{{- $images := .root.Values.images -}}
{{- $tag := default .root.Chart.AppVersion $images.tag -}}
{{- if and (eq $images.variant "cpu") (has .service (list "generator" "trainer")) -}}
{{- $tag = printf "%s-cpu" $tag -}}
{{- end -}}
{{- printf "%s/%s:%s" $images.registry (get $images.names .service) $tag -}}
{{- end -}}

{{/* gRPC port of a service from runConfig, falling back to podrl's defaults. */}}
{{- define "podrl.grpcPort" -}}
{{- $defaults := dict "controller" 50050 "generator" 50051 "grader" 50052 "trainer" 50053 -}}
{{- $section := get .root.Values.runConfig .service | default dict -}}
{{- get $section "grpc_port" | default (get $defaults .service) | int -}}
{{- end -}}

{{/* Prometheus port of a worker service from runConfig (0 = off). */}}
{{- define "podrl.metricsPort" -}}
{{- $defaults := dict "generator" 9101 "grader" 9102 "trainer" 9103 -}}
{{- $section := get .root.Values.runConfig .service | default dict -}}
{{- if hasKey $section "metrics_port" -}}
{{- get $section "metrics_port" | int -}}
{{- else -}}
{{- get $defaults .service -}}
{{- end -}}
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
{{- end -}}

{{/* Is DRA mode usable on the target cluster? Fails with the fix when it is not. */}}
{{- define "podrl.checkGpuMode" -}}
{{- if eq .Values.gpu.mode "dra" -}}
{{- if not (semverCompare ">=1.34.0-0" .Capabilities.KubeVersion.Version) -}}
{{- fail (printf "gpu.mode=dra needs Kubernetes >= 1.34 (resource.k8s.io/v1 ResourceClaims); this cluster is %s: set gpu.mode=devicePlugin" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- end -}}
{{- end -}}
