{{- define "agentrl.name" -}}agentrl{{- end -}}

{{- define "agentrl.labels" -}}
app.kubernetes.io/name: {{ include "agentrl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end -}}

{{- define "agentrl.image" -}}{{ .root.Values.image.registry }}/{{ .name }}:{{ .root.Values.image.tag }}{{- end -}}

{{- define "agentrl.serviceAccount" -}}{{ .Values.serviceAccount.name }}{{- end -}}

{{- define "agentrl.podSecurity" -}}
securityContext:
  runAsNonRoot: true
  runAsUser: 10001
  runAsGroup: 10001
  fsGroup: 10001
  seccompProfile:
    type: RuntimeDefault
{{- end -}}

{{- define "agentrl.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: ["ALL"]
{{- end -}}

{{- define "agentrl.s3Env" -}}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef: {name: {{ .Values.s3.existingSecret }}, key: AWS_ACCESS_KEY_ID}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef: {name: {{ .Values.s3.existingSecret }}, key: AWS_SECRET_ACCESS_KEY}
- name: AWS_DEFAULT_REGION
  value: {{ .Values.s3.region | quote }}
{{- if .Values.s3.endpointUrl }}
- name: AWS_ENDPOINT_URL
  value: {{ .Values.s3.endpointUrl | quote }}
- name: MLFLOW_S3_ENDPOINT_URL
  value: {{ .Values.s3.endpointUrl | quote }}
{{- end }}
{{- end -}}

{{- define "agentrl.pullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}
