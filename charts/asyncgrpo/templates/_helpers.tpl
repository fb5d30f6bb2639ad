{{- define "asyncgrpo.name" -}}asyncgrpo-operator{{- end -}}

{{- define "asyncgrpo.fullname" -}}
{{- if contains "asyncgrpo" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-asyncgrpo-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "asyncgrpo.selectorLabels" -}}
app.kubernetes.io/name: {{ include "asyncgrpo.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "asyncgrpo.labels" -}}
{{ include "asyncgrpo.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: asyncgrpo
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* The operator's permissions; the same rules for a ClusterRole or per-namespace Roles. */}}
{{- define "asyncgrpo.rules" -}}
- apiGroups: [asyncgrpo.dev]
  resources: [asyncgrporuns]
  verbs: [get, list, watch, patch, delete]
- apiGroups: [asyncgrpo.dev]
  resources: [asyncgrporuns/status]
  verbs: [get, patch]
- apiGroups: [asyncgrpo.dev]
  resources: [asyncgrporuns/finalizers]
  verbs: [update]
- apiGroups: [""]
  resources: [pods, configmaps, services, serviceaccounts]
  verbs: [get, list, watch, create, patch, delete]
# secrets: only the gateway token Secret the operator creates for a run and reads back
# after a restart; the operator never reads a run's credentials Secret (the bucket Jobs
# get it as secretKeyRef env from the kubelet)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [apps]
  resources: [deployments, statefulsets]
  verbs: [get, list, watch, create, patch, delete]
# the bucket setup and cleanup Jobs, in the run's namespace (no patch: a changed Job is
# replaced)
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, create, patch, delete]
{{- end -}}

{{/* Rules between values that values.schema.json cannot state; each fails with the value. */}}
{{- define "asyncgrpo.checkValues" -}}
{{- with .Values.leaderElection }}
{{- if .enabled }}
{{- $lease := float64 .leaseDurationSeconds }}
{{- $renew := float64 .renewDeadlineSeconds }}
{{- $retry := float64 .retryPeriodSeconds }}
{{- if not (and (gt $lease $renew) (gt $renew $retry) (gt $retry 0.0)) }}
{{- fail (printf "leaderElection: need leaseDurationSeconds (%v) > renewDeadlineSeconds (%v) > retryPeriodSeconds (%v) > 0 (client-go's rule; the operator would exit at start)" .leaseDurationSeconds .renewDeadlineSeconds .retryPeriodSeconds) }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}
