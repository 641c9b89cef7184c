// Command margo-otelcol is an OpenTelemetry Collector with the few components the
// project's tests and a device need: the OTLP receiver (HTTP and gRPC), the file
// exporter (what a test reads back) and the debug exporter, with the env, file and yaml
// configuration providers. It is the Collector Builder's generated entry point, written
// by hand so that the only inputs are go.mod, go.sum and this file.
package main

import (
	"log"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/confmap/provider/yamlprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/debugexporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/processor"
	"go.opentelemetry.io/collector/processor/batchprocessor"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry/otelconftelemetry"
)

func components() (otelcol.Factories, error) {
	var err error
	factories := otelcol.Factories{}
	factories.Receivers, err = otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	factories.Processors, err = otelcol.MakeFactoryMap[processor.Factory](batchprocessor.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	factories.Exporters, err = otelcol.MakeFactoryMap[exporter.Factory](
		fileexporter.NewFactory(), debugexporter.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	// The collector's own telemetry (its logs; its metrics are switched off in the
	// configurations the project writes).
	factories.Telemetry = otelconftelemetry.NewFactory()
	return factories, nil
}

func main() {
	settings := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "margo-otelcol",
			Description: "OpenTelemetry Collector for margo-gitops (OTLP in, file and debug out)",
			Version:     "0.161.0-margo",
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				ProviderFactories: []confmap.ProviderFactory{
					envprovider.NewFactory(), fileprovider.NewFactory(), yamlprovider.NewFactory(),
				},
			},
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		log.Fatal(err)
	}
}
