{{/* The release's objects are named <release>-jupyter-gpushare unless the release is already
     called that (or fullnameOverride says otherwise); 63 characters at most (DNS labels). */}}
{{- define "jupyter-gpushare.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Kubernetes' recommended labels. Pass a dict: (dict "ctx" $ "component" "scheduler"). */}}
{{- define "jupyter-gpushare.labels" -}}
{{ include "jupyter-gpushare.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: jupyter-gpushare
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The labels a selector matches: stable across upgrades (no version). */}}
{{- define "jupyter-gpushare.selectorLabels" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "jupyter-gpushare.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "jupyter-gpushare.socketPath" -}}
{{ .Values.socketDir }}/scheduler.sock
{{- end -}}
