// Command validate checks Tessera's deployment files offline: every
// Kubernetes manifest decodes strictly into the API's own types (an unknown
// or misplaced field is an error, as the API server's strict validation
// makes it), the kustomization lists every manifest, and the objects fit
// together (selectors, Services, Secrets, ports, probes, metrics, the node
// names the coordinators are given); the compose file loads through the
// Compose specification's own loader and schema, and its nodes and
// coordinator agree. Run by scripts/test-all.sh:
//
//	go run ./deploy/validate deploy
package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"
)

// objects holds the manifests by kind and name.
type objects struct {
	services     map[string]*corev1.Service
	statefulSets map[string]*appsv1.StatefulSet
	configMaps   map[string]*corev1.ConfigMap
	secrets      map[string]*corev1.Secret
	budgets      map[string]*policyv1.PodDisruptionBudget
}

type kustomization struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Labels     []struct {
		Pairs map[string]string `json:"pairs"`
	} `json:"labels"`
	Resources []string `json:"resources"`
}

var problems []string

func fail(format string, args ...any) {
	problems = append(problems, fmt.Sprintf(format, args...))
}

// strict decodes YAML into out, refusing fields the type does not have.
func strict(document []byte, out any) error {
	asJSON, err := yaml.YAMLToJSON(document)
	if err != nil {
		return err
	}
	decoder := json.NewDecoder(bytes.NewReader(asJSON))
	decoder.DisallowUnknownFields()
	return decoder.Decode(out)
}

// add decodes an object of type T strictly and files it by its name.
func add[T any, P interface {
	*T
	GetName() string
}](document []byte, into map[string]*T) error {
	object := P(new(T))
	if err := strict(document, object); err != nil {
		return err
	}
	into[object.GetName()] = (*T)(object)
	return nil
}

func documents(path string) [][]byte {
	text, err := os.ReadFile(path)
	if err != nil {
		fail("%s: %v", path, err)
		return nil
	}
	var out [][]byte
	for _, document := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(text), -1) {
		if strings.TrimSpace(regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(document, "")) != "" {
			out = append(out, []byte(document))
		}
	}
	return out
}

func loadKubernetes(dir string) objects {
	all := objects{map[string]*corev1.Service{}, map[string]*appsv1.StatefulSet{}, map[string]*corev1.ConfigMap{},
		map[string]*corev1.Secret{}, map[string]*policyv1.PodDisruptionBudget{}}
	var listed kustomization
	if err := strict(mustRead(filepath.Join(dir, "kustomization.yaml")), &listed); err != nil {
		fail("kustomization.yaml: %v", err)
	}
	manifests, _ := filepath.Glob(filepath.Join(dir, "*.yaml"))
	for _, path := range manifests {
		name := filepath.Base(path)
		if name == "kustomization.yaml" {
			continue
		}
		if !contains(listed.Resources, name) {
			fail("%s is not in kustomization.yaml's resources", name)
		}
		for index, document := range documents(path) {
			var head struct {
				APIVersion string `json:"apiVersion"`
				Kind       string `json:"kind"`
			}
			if err := yaml.Unmarshal(document, &head); err != nil {
				fail("%s #%d: %v", name, index, err)
				continue
			}
			where := fmt.Sprintf("%s #%d (%s)", name, index, head.Kind)
			var err error
			switch head.APIVersion + " " + head.Kind {
			case "v1 Service":
				err = add(document, all.services)
			case "apps/v1 StatefulSet":
				err = add(document, all.statefulSets)
			case "v1 ConfigMap":
				err = add(document, all.configMaps)
			case "v1 Secret":
				err = add(document, all.secrets)
			case "policy/v1 PodDisruptionBudget":
				err = add(document, all.budgets)
			default:
				err = fmt.Errorf("an object of kind %q (apiVersion %q) the validator does not know", head.Kind, head.APIVersion)
			}
			if err != nil {
				fail("%s: %v", where, err)
			}
		}
	}
	for _, resource := range listed.Resources {
		if _, err := os.Stat(filepath.Join(dir, resource)); err != nil {
			fail("kustomization.yaml lists %s: %v", resource, err)
		}
	}
	return all
}

func mustRead(path string) []byte {
	text, err := os.ReadFile(path)
	if err != nil {
		fail("%s: %v", path, err)
	}
	return text
}

func contains(list []string, item string) bool {
	for _, each := range list {
		if each == item {
			return true
		}
	}
	return false
}

func matches(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for key, value := range selector {
		if labels[key] != value {
			return false
		}
	}
	return true
}

// hasPort says whether a container of the pod declares `port` (by name or number).
func hasPort(pod corev1.PodSpec, port intstr.IntOrString) bool {
	for _, container := range pod.Containers {
		for _, declared := range container.Ports {
			if (port.Type == intstr.String && declared.Name == port.StrVal) ||
				(port.Type == intstr.Int && declared.ContainerPort == port.IntVal) {
				return true
			}
		}
	}
	return false
}

func checkKubernetes(all objects) {
	for _, required := range []string{"tessera-node", "tessera-coordinator"} {
		if all.statefulSets[required] == nil {
			fail("no StatefulSet %s", required)
		}
	}
	for name, set := range all.statefulSets {
		pod := set.Spec.Template
		if set.Spec.Selector == nil || !matches(set.Spec.Selector.MatchLabels, pod.Labels) {
			fail("StatefulSet %s: its selector does not select its own pods", name)
		}
		service := all.services[set.Spec.ServiceName]
		if service == nil || service.Spec.ClusterIP != corev1.ClusterIPNone {
			fail("StatefulSet %s: serviceName %q is not a headless Service here", name, set.Spec.ServiceName)
		} else if !service.Spec.PublishNotReadyAddresses {
			fail("Service %s: peers must resolve pods that are not ready (publishNotReadyAddresses)", service.Name)
		}
		port := pod.Annotations["prometheus.io/port"]
		if pod.Annotations["prometheus.io/scrape"] != "true" || !hasPort(pod.Spec, intstr.Parse(port)) {
			fail("StatefulSet %s: no metrics annotations naming a declared port", name)
		}
		for _, container := range pod.Spec.Containers {
			if container.ReadinessProbe == nil {
				fail("StatefulSet %s container %s: no readiness probe", name, container.Name)
			}
			if name == "tessera-node" && container.LivenessProbe == nil {
				fail("StatefulSet %s container %s: no liveness probe", name, container.Name)
			}
			for _, env := range container.Env {
				if from := env.ValueFrom; from != nil && from.ConfigMapKeyRef != nil {
					ref := from.ConfigMapKeyRef
					if configMap := all.configMaps[ref.Name]; configMap == nil {
						fail("%s: env %s names ConfigMap %s, which is not here", name, env.Name, ref.Name)
					} else if _, ok := configMap.Data[ref.Key]; !ok {
						fail("%s: env %s names key %s, which ConfigMap %s lacks", name, env.Name, ref.Key, ref.Name)
					}
				}
			}
		}
		mounted := map[string]bool{}
		for _, container := range append(pod.Spec.InitContainers, pod.Spec.Containers...) {
			for _, mount := range container.VolumeMounts {
				mounted[mount.Name] = true
			}
		}
		declared := map[string]bool{}
		for _, volume := range pod.Spec.Volumes {
			declared[volume.Name] = true
			if volume.Secret != nil && all.secrets[volume.Secret.SecretName] == nil {
				fail("%s: volume %s names Secret %s, which is not here", name, volume.Name, volume.Secret.SecretName)
			}
			if !mounted[volume.Name] {
				fail("%s: volume %s is mounted nowhere", name, volume.Name)
			}
		}
		for _, claim := range set.Spec.VolumeClaimTemplates {
			declared[claim.Name] = true
		}
		for mount := range mounted {
			if !declared[mount] {
				fail("%s: a mount names volume %s, which is not declared", name, mount)
			}
		}
	}
	for name, service := range all.services {
		selected := false
		for _, set := range all.statefulSets {
			if matches(service.Spec.Selector, set.Spec.Template.Labels) {
				selected = true
				for _, port := range service.Spec.Ports {
					if !hasPort(set.Spec.Template.Spec, port.TargetPort) {
						fail("Service %s: port %s targets %s, which the pods of %s do not declare", name, port.Name, port.TargetPort.String(), set.Name)
					}
				}
			}
		}
		if !selected {
			fail("Service %s selects no pods here", name)
		}
	}
	for name, budget := range all.budgets {
		set := all.statefulSets[name]
		if set == nil || budget.Spec.Selector == nil || !matches(budget.Spec.Selector.MatchLabels, set.Spec.Template.Labels) {
			fail("PodDisruptionBudget %s does not cover the pods of a StatefulSet of its name", name)
		}
	}
	if all.budgets["tessera-node"] == nil {
		fail("no PodDisruptionBudget for the nodes")
	}
	// The names the coordinators are given are the pods the StatefulSets make.
	config := all.configMaps["tessera-config"]
	if config == nil {
		fail("no ConfigMap tessera-config")
		return
	}
	for key, set := range map[string]string{"nodes": "tessera-node", "coordinators": "tessera-coordinator"} {
		stateful := all.statefulSets[set]
		if stateful == nil || stateful.Spec.Replicas == nil {
			continue
		}
		port := map[string]int{"nodes": 7379, "coordinators": 7000}[key]
		var expected []string
		for ordinal := 0; ordinal < int(*stateful.Spec.Replicas); ordinal++ {
			expected = append(expected, fmt.Sprintf("%s-%d.%s:%d", set, ordinal, stateful.Spec.ServiceName, port))
		}
		if got := config.Data[key]; got != strings.Join(expected, ",") {
			fail("tessera-config %s is %q; the StatefulSet %s makes %q", key, got, set, strings.Join(expected, ","))
		}
	}
}

func checkCompose(path string) {
	details := types.ConfigDetails{
		WorkingDir:  filepath.Dir(path),
		ConfigFiles: []types.ConfigFile{{Filename: path}},
		Environment: types.Mapping{},
	}
	project, err := loader.LoadWithContext(context.Background(), details, func(options *loader.Options) {
		options.SetProjectName("tessera", true)
		options.SkipResolveEnvironment = true
	})
	if err != nil {
		fail("%s: %v", path, err)
		return
	}
	coordinator, ok := project.Services["coordinator"]
	if !ok {
		fail("%s: no coordinator service", path)
		return
	}
	flag := func(command types.ShellCommand, name string) string {
		for _, arg := range command {
			if value, found := strings.CutPrefix(arg, "--"+name+"="); found {
				return value
			}
		}
		return ""
	}
	nodes := strings.Split(flag(coordinator.Command, "nodes"), ",")
	nodeServices := 0
	for name, service := range project.Services {
		if name == "coordinator" {
			continue
		}
		nodeServices++
		id := flag(service.Command, "node-id")
		place, err := strconv.Atoi(id)
		if want := fmt.Sprintf("%s:%s", name, flag(service.Command, "port")); err != nil || place < 0 || place >= len(nodes) || nodes[place] != want {
			fail("%s: service %s (node-id %q) is not at its place in the coordinator's --nodes %v", path, name, id, nodes)
		}
		if flag(service.Command, "coordinator") != "coordinator:"+flag(coordinator.Command, "port") {
			fail("%s: service %s does not name the coordinator", path, name)
		}
		if flag(service.Command, "cluster-id") != flag(coordinator.Command, "cluster-id") {
			fail("%s: service %s is in another cluster than the coordinator", path, name)
		}
		if service.HealthCheck == nil {
			fail("%s: service %s has no health check", path, name)
		}
	}
	if nodeServices != len(nodes) {
		fail("%s: %d node services for %d nodes in the map", path, nodeServices, len(nodes))
	}
}

// validate checks the deployment files under dir: the problems found, and
// what was checked.
func validate(dir string) ([]string, objects) {
	problems = nil
	all := loadKubernetes(filepath.Join(dir, "kubernetes"))
	checkKubernetes(all)
	checkCompose(filepath.Join(dir, "compose", "compose.yaml"))
	return problems, all
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: validate DEPLOY_DIR")
		os.Exit(2)
	}
	problems, all := validate(os.Args[1])
	if len(problems) > 0 {
		for _, problem := range problems {
			fmt.Fprintln(os.Stderr, "deploy:", problem)
		}
		os.Exit(1)
	}
	fmt.Printf("deploy: %d Services, %d StatefulSets, %d ConfigMaps, %d Secrets, %d PodDisruptionBudgets and the compose file check out\n",
		len(all.services), len(all.statefulSets), len(all.configMaps), len(all.secrets), len(all.budgets))
}
