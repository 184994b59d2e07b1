{{/* Names, labels and the pod pieces shared by every cache-indexer Deployment. */}}

{{- define "cache-indexer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cache-indexer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* A component's resource name; called with (dict "root" $ "component" "l1-ingest"). */}}
{{- define "cache-indexer.componentName" -}}
{{- printf "%s-%s" (include "cache-indexer.fullname" .root) .component | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cache-indexer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cache-indexer.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cache-indexer.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "cache-indexer.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "cache-indexer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cache-indexer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "cache-indexer.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Redis URL written into config.yaml; empty when it comes from a Secret. */}}
{{- define "cache-indexer.redisURL" -}}
{{- if .Values.redis.url }}
{{- .Values.redis.url }}
{{- else if .Values.redis.existingSecret }}
{{- else if .Values.redis.sentinel.addresses }}
{{- else if .Values.redis.enabled }}
{{- printf "redis://%s:%d/0" (include "cache-indexer.componentName" (dict "root" . "component" "redis")) (int .Values.redis.port) }}
{{- else }}
{{- fail "cache-indexer: set redis.url, redis.existingSecret, or redis.enabled=true" }}
{{- end }}
{{- end }}

{{/* Where the Redis TLS Secret is mounted in every cache-indexer container. */}}
{{- define "cache-indexer.redisTLSDir" -}}/etc/redis-tls{{- end }}

{{/* Where the Redis Sentinel TLS Secret is mounted. */}}
{{- define "cache-indexer.sentinelTLSDir" -}}/etc/redis-sentinel-tls{{- end }}

{{/* "true" when the chart runs its own Redis (redis.enabled and no external URL/Secret). */}}
{{- define "cache-indexer.bundledRedis" -}}
{{- if and .Values.redis.enabled (not .Values.redis.url) (not .Values.redis.existingSecret) (not .Values.redis.sentinel.addresses) }}true{{ end }}
{{- end }}

{{- define "cache-indexer.configPath" -}}/etc/cache-indexer/config.yaml{{- end }}

{{/*
Pod metadata of a cache-indexer component: (dict "root" $ "component" "api").
The config checksum restarts the pods when the ConfigMap changes.
*/}}
{{- define "cache-indexer.podMetadata" -}}
annotations:
  checksum/config: {{ include (print .root.Template.BasePath "/configmap.yaml") .root | sha256sum }}
  {{- with .root.Values.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
labels:
  {{- include "cache-indexer.selectorLabels" . | nindent 2 }}
  {{- with .root.Values.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* Pod-level fields shared by every cache-indexer pod: (dict "root" $ "kubeAPI" bool). */}}
{{- define "cache-indexer.podSpecCommon" -}}
serviceAccountName: {{ include "cache-indexer.serviceAccountName" .root }}
{{- /* Only discovery talks to the Kubernetes API; the others get no token. */}}
automountServiceAccountToken: {{ .kubeAPI }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .root.Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: config
    configMap:
      name: {{ include "cache-indexer.componentName" (dict "root" .root "component" "config") }}
  - name: tmp
    emptyDir: {}
  {{- if .root.Values.redis.tls.secret }}
  - name: redis-tls
    secret:
      secretName: {{ .root.Values.redis.tls.secret }}
  {{- end }}
  {{- if .root.Values.redis.sentinel.tls.secret }}
  - name: redis-sentinel-tls
    secret:
      secretName: {{ .root.Values.redis.sentinel.tls.secret }}
  {{- end }}
{{- end }}

{{/* Container fields shared by every cache-indexer container: (dict "root" $ "resources" map). */}}
{{- define "cache-indexer.containerCommon" -}}
image: {{ include "cache-indexer.image" .root }}
imagePullPolicy: {{ .root.Values.image.pullPolicy }}
env:
  - name: CACHE_INDEXER_CONFIG
    value: {{ include "cache-indexer.configPath" .root }}
  - name: POD_NAMESPACE
    valueFrom:
      fieldRef:
        fieldPath: metadata.namespace
  - name: POD_NAME
    valueFrom:
      fieldRef:
        fieldPath: metadata.name
  {{- if and .root.Values.redis.existingSecret (not .root.Values.redis.url) }}
  - name: CACHE_INDEXER_REDIS_URL
    valueFrom:
      secretKeyRef:
        name: {{ .root.Values.redis.existingSecret }}
        key: {{ .root.Values.redis.existingSecretKey }}
  {{- end }}
  {{- if .root.Values.redis.passwordSecret }}
  - name: CACHE_INDEXER_REDIS_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ .root.Values.redis.passwordSecret }}
        key: {{ .root.Values.redis.passwordSecretKey }}
  {{- end }}
  {{- if .root.Values.redis.sentinel.existingSecret }}
  - name: CACHE_INDEXER_REDIS_SENTINEL_PASSWORD
    valueFrom:
      secretKeyRef:
        name: {{ .root.Values.redis.sentinel.existingSecret }}
        key: {{ .root.Values.redis.sentinel.existingSecretKey }}
  {{- end }}
  {{- with .root.Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
securityContext:
  {{- toYaml .root.Values.securityContext | nindent 2 }}
resources:
  {{- toYaml (default .root.Values.resources .resources) | nindent 2 }}
volumeMounts:
  - name: config
    mountPath: /etc/cache-indexer
    readOnly: true
  - name: tmp
    mountPath: /tmp
  {{- if .root.Values.redis.tls.secret }}
  - name: redis-tls
    mountPath: {{ include "cache-indexer.redisTLSDir" .root }}
    readOnly: true
  {{- end }}
  {{- if .root.Values.redis.sentinel.tls.secret }}
  - name: redis-sentinel-tls
    mountPath: {{ include "cache-indexer.sentinelTLSDir" .root }}
    readOnly: true
  {{- end }}
{{- end }}

{{/*
A worker Deployment (discovery, l1-ingest, l3-poll):
(dict "root" $ "component" "l3-poll" "values" .Values.l3Poller "kubeAPI" false)
*/}}
{{- define "cache-indexer.worker" -}}
{{- $root := .root -}}
{{- $ctx := dict "root" $root "component" .component -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "cache-indexer.componentName" $ctx }}
  labels:
    {{- include "cache-indexer.labels" $ctx | nindent 4 }}
spec:
  replicas: {{ .values.replicas }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      maxSurge: 1
      maxUnavailable: 0
  selector:
    matchLabels:
      {{- include "cache-indexer.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      {{- include "cache-indexer.podMetadata" $ctx | nindent 6 }}
    spec:
      {{- include "cache-indexer.podSpecCommon" (dict "root" $root "kubeAPI" .kubeAPI) | nindent 6 }}
      containers:
        - name: {{ .component }}
          {{- include "cache-indexer.containerCommon" (dict "root" $root "resources" .values.resources) | nindent 10 }}
          args:
            - {{ .component }}
            - --config
            - {{ include "cache-indexer.configPath" $root }}
            {{- if $root.Values.metrics.enabled }}
            - --metrics-port
            - {{ $root.Values.metrics.port | int | quote }}
            {{- end }}
          {{- if $root.Values.metrics.enabled }}
          ports:
            - name: metrics
              containerPort: {{ $root.Values.metrics.port | int }}
              protocol: TCP
          {{- end }}
          {{- /* /healthz fails once a loop has made no progress for metrics.livenessTimeout
          (the process already waited that long: 3 failed probes more restart it); /readyz
          fails while the worker cannot do its work (e.g. Redis unreachable). */}}
          {{- if and $root.Values.metrics.enabled $root.Values.metrics.livenessProbe }}
          livenessProbe:
            httpGet:
              path: /healthz
              port: metrics
            initialDelaySeconds: 10
            periodSeconds: 10
            failureThreshold: 3
          {{- end }}
          {{- if and $root.Values.metrics.enabled $root.Values.metrics.readinessProbe }}
          readinessProbe:
            httpGet:
              path: /readyz
              port: metrics
            initialDelaySeconds: 2
            periodSeconds: 5
            failureThreshold: 3
          {{- end }}
{{- end }}
