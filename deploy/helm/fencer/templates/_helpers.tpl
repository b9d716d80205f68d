{{/*
Names. The chart name, overridable; the full name is the release name
when that already contains the chart name (release "fencer" gives
"fencer-gateway", not "fencer-fencer-gateway").
*/}}
{{- define "fencer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fencer.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "fencer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object names of the components. */}}
{{- define "fencer.gateway.name" -}}{{ include "fencer.fullname" . | trunc 55 | trimSuffix "-" }}-gateway{{- end -}}
{{- define "fencer.injector.name" -}}{{ include "fencer.fullname" . | trunc 54 | trimSuffix "-" }}-injector{{- end -}}
{{/* Trial objects: include "fencer.trial.name" (dict "ctx" $ "component" "redis"). */}}
{{- define "fencer.trial.name" -}}{{ include "fencer.fullname" .ctx | trunc 50 | trimSuffix "-" }}-{{ .component }}{{- end -}}

{{/*
Standard labels: include "fencer.labels" (dict "ctx" $ "component" "gateway").
Every object carries them (deploy/check_chart.py checks).
*/}}
{{- define "fencer.labels" -}}
helm.sh/chart: {{ include "fencer.chart" .ctx }}
{{ include "fencer.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: fencer
{{- end -}}

{{/* The subset that selects a component's pods (immutable once installed). */}}
{{- define "fencer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fencer.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/*
The fencer image: repository@digest when a digest is given (a tag can be
moved, a digest cannot), else repository:tag (tag defaults to appVersion).
*/}}
{{- define "fencer.image" -}}
{{- $i := .Values.image -}}
{{- if $i.digest -}}
{{- printf "%s@%s" $i.repository $i.digest -}}
{{- else -}}
{{- printf "%s:%s" $i.repository (default .Chart.AppVersion $i.tag) -}}
{{- end -}}
{{- end -}}

{{/* Pod-level hardening shared by every fencer pod. */}}
{{- define "fencer.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Container-level hardening shared by every container. */}}
{{- define "fencer.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Name of the Secret holding the token-signing key. */}}
{{- define "fencer.signing.secretName" -}}
{{- default .Values.signing.secretName .Values.signing.existingSecret -}}
{{- end -}}

{{/* The per-app-namespace objects the injected sidecars read. */}}
{{- define "fencer.sidecar.configMapName" -}}fencer-sidecar-config{{- end -}}

{{/*
The Secret of FENCER__* variables for the sidecars: the chart's own when it
has any to write (sidecar.env, or the trial's Redis URL), else the user's
existing one, else none ("").
*/}}
{{- define "fencer.sidecar.envSecretName" -}}
{{- if or .Values.sidecar.env .Values.trial.enabled -}}
fencer-sidecar-env
{{- else -}}
{{- .Values.sidecar.existingEnvSecret -}}
{{- end -}}
{{- end -}}

{{/* The gateway's in-cluster URL, as sidecars in other namespaces see it. */}}
{{- define "fencer.gateway.url" -}}
http://{{ include "fencer.gateway.name" . }}.{{ .Release.Namespace }}.svc:8080
{{- end -}}

{{/* The Secret and key of the gateway's PostgreSQL URL. */}}
{{- define "fencer.gateway.postgresSecret" -}}
{{- if .Values.trial.enabled -}}
{{ include "fencer.trial.name" (dict "ctx" . "component" "trial-credentials") }}
{{- else -}}
{{ required "gateway.postgres.existingSecret is required (a Secret whose key gateway.postgres.existingSecretKey holds the PostgreSQL URL), unless trial.enabled" .Values.gateway.postgres.existingSecret }}
{{- end -}}
{{- end -}}
{{- define "fencer.gateway.postgresKey" -}}
{{- if .Values.trial.enabled -}}postgres-url{{- else -}}{{ .Values.gateway.postgres.existingSecretKey }}{{- end -}}
{{- end -}}

{{/* The injector's webhook TLS Secret (generated, cert-manager's, or the user's). */}}
{{- define "fencer.injector.tlsSecretName" -}}
{{- if eq .Values.injector.tls.mode "secret" -}}
{{- required "injector.tls.secretName is required when injector.tls.mode is secret" .Values.injector.tls.secretName -}}
{{- else -}}
{{- include "fencer.injector.name" . }}-tls
{{- end -}}
{{- end -}}
